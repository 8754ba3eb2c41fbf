"""Count the flags a real run refuses on CPU without a hardware reason ("not supported yet"), by group.

Megatron flags (the mirror) are counted by their NOT_BUILT group (relax.config.support_megatron); Relax's own
flags (the configuration reference's) by the flag module that defines them. A flag is refused when it is not
built (relax.config.support.IMPLEMENTED), has no no-effect reason and is not GPU-only; SGLang server flags are
left out (they are honoured with --rollout-backend sglang). Usage: .venv/bin/python scripts/count_refused_flags.py [-v]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relax.config.flags import GROUP_MODULES  # noqa: E402
from relax.config.megatron_mirror import ROWS  # noqa: E402
from relax.config.parser import RelaxArgumentParser, actions_by_dest, build_parser  # noqa: E402
from relax.config.support import IMPLEMENTED, is_sglang_server_flag  # noqa: E402
from relax.config.support_gpu import GPU_ONLY_FEATURES  # noqa: E402
from relax.config.support_megatron import NO_EFFECT_REASONS, NOT_BUILT  # noqa: E402


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


if __name__ == "__main__":
    main()
