"""Relax's configuration layer: one flat namespace, validated once, handed out immutable."""

from relax.config.config import Config
from relax.config.errors import ConfigError
from relax.config.parser import build_parser, parse_config

__all__ = ["Config", "ConfigError", "build_parser", "parse_config"]
