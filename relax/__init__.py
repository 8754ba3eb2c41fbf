"""Relax: Ray-actor distributed RL post-training for LLMs."""

__version__ = "0.1.0"
