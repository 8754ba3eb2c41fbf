"""Write docs/configuration.md from the parser itself (the flag reference cannot drift).

    .venv/bin/python scripts/gen_config_docs.py            # rewrite the file
    .venv/bin/python scripts/gen_config_docs.py --check    # exit 1 when the committed file is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DOC = ROOT / "docs" / "configuration.md"


def _default(action: argparse.Action) -> str:
    """The effective default, in the words `--help` uses (parser default, derivation, embedded preset)."""
    from relax.config.help_text import default_text

    return default_text(action).removeprefix("default: ").replace("|", "\\|")


def _type(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "switch"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "switch (--no- to negate)"
    name = getattr(action.type, "__name__", "str") if action.type else "str"
    name = {"str2bool": "bool", "json_object": "JSON object", "byte_size": "bytes (512MB ok)"}.get(name, name)
    if action.nargs in ("+", "*"):
        name += " list"
    if isinstance(action, argparse._AppendAction):
        name += " (repeatable)"
    return name


def render() -> str:
    from relax.config.parser import build_parser

    parser, _ = build_parser(use_megatron_parser=False, use_sglang_parser=False)
    lines = [
        "# Relax configuration reference",
        "",
        "Generated from the parser by `scripts/gen_config_docs.py`; do not edit by hand.",
        "All flags live in one flat namespace. Config files (`--custom-config-path`) take the same names",
        "(kebab or snake case). Megatron flags are listed as the built-in mirror; with Megatron-LM importable",
        "every Megatron flag is accepted. SGLang server flags are `--sglang-<flag>`; without SGLang installed",
        "any `--sglang-*` flag is accepted and checked when a real SGLang engine starts.",
        "",
    ]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        lines += [f"## {group.title}", "", "| flag | type | default | meaning |", "|---|---|---|---|"]
        for a in actions:
            choices = f" Choices: {', '.join(map(str, a.choices))}." if a.choices else ""
            help_text = (a.help or "").replace("|", "\\|").replace("\n", " ") + choices
            lines.append(f"| `{', '.join(a.option_strings)}` | {_type(a)} | {_default(a)} | {help_text} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    check = "--check" in sys.argv
    text = render()
    if check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is stale: run .venv/bin/python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
