"""Megatron's flags in Relax's namespace: Megatron-LM's own parser when importable, else the mirror."""

from __future__ import annotations

import argparse

from relax.config import megatron_table
from relax.config.megatron_mirror import ROWS

# Defaults Relax changes for RL post-training (the configuration reference states these).
RELAX_DEFAULT_OVERRIDES = {
    "lr": 1e-6,
    "micro_batch_size": 1,
    "expert_tensor_parallel_size": 1,
    "no_save_optim": False,
    # RL fine-tuning trains without dropout (log-probs of the update must match the rollout's); Megatron's 0.1
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    # the trainer's micro-batches vary in length, which only the all-to-all dispatcher handles (Megatron: allgather)
    "moe_token_dispatcher_type": "alltoall",
}


def megatron_parser_available() -> bool:
    try:
        import megatron.training.arguments  # noqa: F401
    except Exception:
        return False
    return True


def add_megatron_flags(parser: argparse.ArgumentParser, use_megatron_parser: bool | None = None) -> str:
    """Merge Megatron's flags into `parser`; returns "megatron-lm" or "mirror".

    Flags Relax already defines (for example --eval-interval, counted in rollout steps) are kept
    as Relax's. Megatron's own parser contributes every flag it has; the mirror contributes the
    groups listed in `megatron_table.MIRRORED_GROUPS`.
    """
    if use_megatron_parser is None:
        use_megatron_parser = megatron_parser_available()
    taken = set(parser._option_string_actions)
    if use_megatron_parser:
        import megatron.training.arguments as margs

        source = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        margs.add_megatron_arguments(source)
        for group in source._action_groups:
            target = None
            for action in group._group_actions:
                if not action.option_strings or any(o in taken for o in action.option_strings):
                    continue
                if target is None:
                    target = parser.add_argument_group(f"Megatron: {group.title}")
                target._add_action(action)
        origin = "megatron-lm"
    else:
        megatron_table.add_rows(parser, ROWS, taken)
        origin = "mirror"
    known = {a.dest for a in parser._actions}
    parser.set_defaults(**{k: v for k, v in RELAX_DEFAULT_OVERRIDES.items() if k in known})
    return origin
