"""Built-in dynamic-sampling filters (`--dynamic-sampling-filter-path`): `fn(args, group) -> bool`, keep the
prompt's group? Scripts name them by their old path, `relax.engine.filters.dynamic_sampling_filters` (relax.config.hook_paths)."""

from __future__ import annotations

import statistics
from typing import Any, Sequence


def _reward(sample: Any) -> float:
    reward = sample.reward if hasattr(sample, "reward") else sample["reward"]
    return float(reward)


def check_reward_nonzero_std(args: Any, group: Sequence[Any]) -> bool:
    """Keep a prompt's group only if its rewards differ (DAPO dynamic sampling).

    A group whose samples all scored the same gives every sample a zero GRPO advantage, so it carries
    no learning signal and only dilutes the batch.
    """
    rewards = [_reward(s) for s in group]
    return len(rewards) > 1 and statistics.pstdev(rewards) > 0.0
