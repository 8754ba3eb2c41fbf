"""Build the one flat parser and turn argv (+ config files) into a validated `Config`.

Order of precedence: parser defaults < Relax presets (embedded default only) < config files (left
to right) < command line. Validation runs once, after everything is merged.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import sys
from typing import Any, Sequence

from relax.config.config import Config
from relax.config.errors import ConfigError
from relax.config.files import load_config_files, resolve_interpolations
from relax.config.flags import add_relax_flags
from relax.config.help_text import EPILOG, RelaxHelpFormatter, describe_flags
from relax.config.megatron import add_megatron_flags
from relax.config.sglang import add_router_flags, add_sglang_flags, take_passthrough
from relax.config.validate import derived_facts, restated_derivations, validate_and_derive


class _Unset:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<unset>"


UNSET = _Unset()


class RelaxArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors become `ConfigError` (the entry point exits 2)."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(message)


@functools.lru_cache(maxsize=4)
def build_parser(use_megatron_parser: bool | None = None,
                 use_sglang_parser: bool | None = None) -> tuple[RelaxArgumentParser, dict[str, str]]:
    """The merged parser and where each family of flags came from."""
    parser = RelaxArgumentParser(
        prog="relax-train",
        description="Relax: distributed RL post-training of LLMs on Ray (Megatron-core trainers, "
                    "SGLang-API rollout engines, TransferQueue data plane).",
        allow_abbrev=False,
        formatter_class=RelaxHelpFormatter,
        epilog=EPILOG,
    )
    add_relax_flags(parser)
    relax_dests = {a.dest for a in parser._actions}
    megatron_origin = add_megatron_flags(parser, use_megatron_parser)
    megatron_dests = {a.dest for a in parser._actions} - relax_dests
    sglang_origin = add_sglang_flags(parser, use_sglang_parser)
    add_router_flags(parser)
    sources = {"megatron": megatron_origin, "sglang": sglang_origin}
    parser.set_defaults()  # keep overrides applied
    parser._relax_dests = frozenset(relax_dests - {"help"})  # type: ignore[attr-defined]
    parser._megatron_dests = frozenset(megatron_dests)  # type: ignore[attr-defined]
    describe_flags(parser, parser._megatron_dests)  # type: ignore[attr-defined]
    return parser, sources


def actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def parser_defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    return {dest: parser.get_default(dest) for dest in actions_by_dest(parser)}


def _suggest(token: str, parser: argparse.ArgumentParser) -> str:
    name = token.split("=", 1)[0]
    options = [o for o in parser._option_string_actions if o.startswith("--")]
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def parse_config(argv: Sequence[str] | None = None, *, use_megatron_parser: bool | None = None) -> Config:
    """Parse, merge files, validate and derive. Raises ConfigError on any bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, sources = build_parser(use_megatron_parser)
    actions = actions_by_dest(parser)
    # Pre-set every dest to UNSET so that the dests still UNSET afterwards are the ones not given.
    # Append actions need a list to append to, so they start at their default (None) instead.
    namespace = argparse.Namespace(**{dest: None if isinstance(a, argparse._AppendAction) else UNSET
                                      for dest, a in actions.items()})
    namespace, unknown = parser.parse_known_args(argv, namespace=namespace)
    passthrough, rest = take_passthrough(unknown)
    if rest:
        first = next((t for t in rest if t.startswith("--")), rest[0])
        if first.startswith("--"):
            raise ConfigError(f"unrecognized flag {first}{_suggest(first, parser)}")
        where = argv.index(first) if first in argv else -1
        after = f" after {argv[where - 1]}" if where > 0 else ""
        raise ConfigError(f"unexpected value {first!r}{after} (that flag takes no value, or takes fewer values)")
    cli = {dest: val for dest, val in vars(namespace).items()
           if val is not UNSET and not (val is None and isinstance(actions[dest], argparse._AppendAction))}
    cli.update(passthrough)

    file_values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if cli.get("custom_config_path"):
        file_values, origin = load_config_files(cli["custom_config_path"], actions)

    values = parser_defaults(parser)
    values.update(file_values)
    values.update(cli)
    values = resolve_interpolations(values, actions, origin)
    explicit = frozenset(file_values) | frozenset(cli)
    defaults = parser_defaults(parser)
    pre_derivation = dict(values)
    values, embedded = validate_and_derive(values, explicit, defaults)
    explicit = explicit - restated_derivations(pre_derivation, explicit, defaults)
    meta = {
        "sources": dict(sources),
        "defaults": parser_defaults(parser),
        "from_files": dict(origin),
        "embedded_default": embedded,
        "relax_dests": parser._relax_dests,  # type: ignore[attr-defined]
        "megatron_dests": parser._megatron_dests,  # type: ignore[attr-defined]
        "argv": argv,
        "flag_names": {dest: a.option_strings[0] for dest, a in actions.items()},
    }
    return Config(values, explicit, meta, derived_facts(values))
