"""Count the flags a real run refuses on CPU without a hardware reason ("not supported yet"), by group.

Megatron flags (the mirror) are counted by their NOT_BUILT group (relax.config.support_megatron); Relax's own
flags (the configuration reference's) by the flag module that defines them. A flag is refused when it is not
built (relax.config.support.IMPLEMENTED), has no no-effect reason and is not GPU-only; SGLang server flags are
left out (they are honoured with --rollout-backend sglang).

The launch files (examples/launch and its model flag files, which restate the public launch scripts and model flag
files: the fully-async script's --megatron-to-hf-mode bridge, Llama 3.1's --use-rope-scaling --rotary-scaling-factor)
are read as bash passes them, each `${VAR:-default}` at its default, and each flag they set is sorted by value:
accepted, refused for a hardware reason (GPU-only), refused for a stated dependency reason
(relax.config.support_deps), or refused without one. Usage: .venv/bin/python scripts/count_refused_flags.py [-v]
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relax.config.flags import GROUP_MODULES  # noqa: E402
from relax.config.megatron_mirror import ROWS  # noqa: E402
from relax.config.parser import RelaxArgumentParser, actions_by_dest, build_parser  # noqa: E402
from relax.config.support import (IMPLEMENTED, SUPPORTED_VALUES, is_sglang_server_flag,  # noqa: E402
                                  is_supported_value, same_value)
from relax.config.support_deps import dependency_reason  # noqa: E402
from relax.config.support_gpu import GPU_ONLY_FEATURES  # noqa: E402
from relax.config.support_megatron import NO_EFFECT_REASONS, NOT_BUILT  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_DIR = ROOT / "examples" / "launch"


def _relax_groups() -> dict[str, str]:
    """dest -> the flags module (group of the reference) that defines it."""
    out = {}
    for module in GROUP_MODULES:
        parser = RelaxArgumentParser(add_help=False)
        module.add_flags(parser)
        for dest in actions_by_dest(parser):
            out[dest] = module.__name__.rsplit(".", 1)[-1]
    return out


def refused() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    parser, _ = build_parser(use_megatron_parser=False)
    dests = set(actions_by_dest(parser))
    accepted = IMPLEMENTED | GPU_ONLY_FEATURES | set(NO_EFFECT_REASONS)
    mirror = {row[2] for row in ROWS} & dests
    group_of = {d: g for g, (_, ds) in NOT_BUILT.items() for d in ds}
    megatron: dict[str, list[str]] = {}
    for dest in sorted(mirror - accepted):
        megatron.setdefault(group_of.get(dest, "(no group)"), []).append(dest)
    relax_group = _relax_groups()
    relax: dict[str, list[str]] = {}
    for dest in sorted((set(relax_group) & dests) - mirror - accepted):
        if not is_sglang_server_flag(dest):
            relax.setdefault(relax_group[dest], []).append(dest)
    return megatron, relax


def categories() -> dict[str, int]:
    """How many mirrored Megatron flags are in each category."""
    parser, _ = build_parser(use_megatron_parser=False)
    mirror = {row[2] for row in ROWS} & set(actions_by_dest(parser))
    return {"built": len(mirror & (IMPLEMENTED - GPU_ONLY_FEATURES)), "GPU-only": len(mirror & GPU_ONLY_FEATURES),
            "no effect (warned)": len(mirror & set(NO_EFFECT_REASONS)),
            "refused": len(mirror - IMPLEMENTED - GPU_ONLY_FEATURES - set(NO_EFFECT_REASONS)), "all": len(mirror)}


def _launch_tokens(path: Path) -> list[str]:
    """The words of a launch file as bash splits them, each `${VAR:-default}` and each `$VAR` assigned from one
    at its default (HF_MODE="${HF_MODE:-bridge}" makes "$HF_MODE" bridge)."""
    text = path.read_text()
    assigned = dict(re.findall(r'^\s*(\w+)="?\$\{\1:-([^}]*)\}"?\s*$', text, flags=re.M))
    text = re.sub(r"\$\{\w+:-([^}]*)\}", lambda m: m.group(1), text)
    text = re.sub(r"\$(\w+)\b", lambda m: assigned.get(m.group(1), m.group(0)), text)
    words = shlex.shlex(text, posix=True, punctuation_chars="();")  # an array's ")" ends its last word
    words.whitespace_split = True
    return list(words)


def launch_flags(paths: list[Path]) -> dict[str, tuple[str, object, list[str]]]:
    """--flag (with its value where only some values are built) -> (dest, the value the launch files give it, or
    `_DEFAULT`, the files), over `paths`."""
    parser, _ = build_parser(use_megatron_parser=False)
    by_option = {opt: a for a in parser._actions for opt in a.option_strings}
    out: dict[str, tuple[str, object, list[str]]] = {}
    for path in paths:
        words = _launch_tokens(path)
        for i, word in enumerate(words):
            action = by_option.get(word)
            if action is None:
                continue
            if action.nargs == 0:  # a switch: what setting it stores
                value = action.const
            else:
                value = words[i + 1] if i + 1 < len(words) else None
            if value is not None and action.nargs != 0 and callable(action.type):
                try:
                    value = action.type(value)
                except (TypeError, ValueError, argparse.ArgumentTypeError):
                    pass  # compared as written
            if same_value(value, action.default):  # a real run refuses no flag at its default
                value = _DEFAULT
            name = f"{word} {value}" if action.dest in SUPPORTED_VALUES and value is not _DEFAULT else word
            dest, _, files = out.setdefault(name, (action.dest, value, []))
            files.append(str(path.relative_to(ROOT)))
    return out


_DEFAULT = object()  # a launch file's value that is the flag's default


def launch_status(dest: str, value: object) -> str:
    """accepted | hardware (GPU-only) | dependency (a stated conflict) | refused (not built)."""
    if value is _DEFAULT:
        return "accepted"
    if dest in SUPPORTED_VALUES and value is not None and not is_supported_value(dest, value):
        return "dependency" if dependency_reason(dest, value) else "refused"
    if dest in GPU_ONLY_FEATURES:
        return "hardware"
    if dest in IMPLEMENTED or dest in NO_EFFECT_REASONS or is_sglang_server_flag(dest):
        return "accepted"
    return "refused"


def launch_report(verbose: bool = False) -> tuple[int, list[str]]:
    """(how many launch-file flags are refused without a hardware or dependency reason, the report's lines)."""
    paths = sorted(LAUNCH_DIR.glob("*.sh")) + sorted((LAUNCH_DIR / "models").glob("*.sh"))
    flags = launch_flags(paths)
    status: dict[str, list[str]] = {}
    for name, (dest, value, _) in sorted(flags.items()):
        status.setdefault(launch_status(dest, value), []).append(name)
    lines = [f"Launch-file flags ({len(flags)} flag settings in {len(paths)} files of examples/launch): "
             + ", ".join(f"{k} {len(v)}" for k, v in sorted(status.items()))]
    for name in status.get("dependency", []):
        dest, value, files = flags[name]
        why = dependency_reason(dest, value)
        lines.append(f"  refused for a dependency reason: {name} ({', '.join(files)}): {why}")
    for kind in ("hardware", "refused"):
        if verbose or kind == "refused":
            lines.extend(f"  {kind}: {name} ({', '.join(flags[name][2])})" for name in status.get(kind, []))
    lines.append(f"Launch-file flags refused without a hardware or dependency reason: {len(status.get('refused', []))}")
    return len(status.get("refused", [])), lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-v", "--verbose", action="store_true", help="list each refused flag")
    args = ap.parse_args()
    print("Megatron flags by category: " + ", ".join(f"{k} {n}" for k, n in categories().items()))
    megatron, relax = refused()
    for title, groups in (("Megatron flags", megatron), ("Relax flags", relax)):
        counts = Counter({g: len(d) for g, d in groups.items()})
        print(f"{title} refused without a hardware reason: {sum(counts.values())}")
        for group, n in counts.most_common():
            print(f"  {n:4d}  {group}")
            if args.verbose:
                print("        " + " ".join(groups[group]))
    print("\n".join(launch_report(args.verbose)[1]))


if __name__ == "__main__":
    main()
