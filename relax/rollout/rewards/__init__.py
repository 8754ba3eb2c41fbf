"""Reward functions for rollouts.

* ``get_reward_fn(rm_type, **options)`` -> ``fn(response, label, metadata) -> float | dict``
  for the built-ins (``exact_match``, ``math``, ``dapo``, ``deepscaler``, ``f1``, ``gpqa``,
  ``multiple_choice``, ``random``, ``remote_rm``) and ``boxed_<type>``.
* ``resolve_rm_type(flag, metadata)``: per-sample ``metadata["rm_type"]`` override.
* ``load_custom_reward("pkg.module.func")``: a user ``fn(args, sample)`` (sync or async).
* ``RewardRunner`` / ``score_samples``: concurrent scoring, group rewards, ``reward_key``,
  failure policy ``on_error="fail" | "zero"``.
"""

from relax.rollout.rewards.custom import CustomReward, import_by_path, load_custom_reward
from relax.rollout.rewards.math_grader import (
    extract_boxed,
    extract_math_answer,
    grade_answer,
    is_equiv,
    normalize_answer,
)
from relax.rollout.rewards.registry import (
    available_reward_types,
    get_reward_fn,
    register_reward,
    resolve_rm_type,
)
from relax.rollout.rewards.remote import RemoteRewardError, RemoteRewardModel
from relax.rollout.rewards.runner import (
    RewardError,
    RewardResult,
    RewardRunner,
    ascore_samples,
    reward_to_float,
    score_samples,
)

__all__ = [
    "CustomReward",
    "RemoteRewardError",
    "RemoteRewardModel",
    "RewardError",
    "RewardResult",
    "RewardRunner",
    "ascore_samples",
    "available_reward_types",
    "extract_boxed",
    "extract_math_answer",
    "get_reward_fn",
    "grade_answer",
    "import_by_path",
    "is_equiv",
    "load_custom_reward",
    "normalize_answer",
    "register_reward",
    "resolve_rm_type",
    "reward_to_float",
    "score_samples",
]
