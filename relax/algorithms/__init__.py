"""RL algorithm math for Relax: advantage estimators, KL estimators, policy/value losses,
reducers and off-policy corrections. Pure functions on torch tensors (no state, no I/O).

Conventions: per-token tensors are padded ``[B, T]`` with a ``mask [B, T]`` (1 = response
token that counts in the loss); per-sample tensors are ``[B]``; groups are ``group_ids [B]``.
"""

from ._utils import pad_rows
from .advantages import (
    broadcast_to_tokens,
    discounted_returns,
    gae_advantages,
    group_mean_baseline,
    grpo_advantages,
    kl_penalized_token_rewards,
    opd_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
    whiten,
)
from .corrections import mismatch_metrics, opsm_mask, sequence_log_ratio, tis_weights
from .kl import KL_KINDS, kl_estimate
from .losses import (
    REDUCTIONS,
    cispo_policy_loss,
    entropy_bonus_loss,
    entropy_from_logits,
    gspo_policy_loss,
    ppo_policy_loss,
    reduce_loss,
    sample_mean,
    sapo_policy_loss,
    sft_loss,
    sum_of_sample_mean,
    token_mean,
    value_loss,
)

__all__ = [
    "KL_KINDS",
    "REDUCTIONS",
    "broadcast_to_tokens",
    "cispo_policy_loss",
    "discounted_returns",
    "entropy_bonus_loss",
    "entropy_from_logits",
    "gae_advantages",
    "group_mean_baseline",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_estimate",
    "kl_penalized_token_rewards",
    "mismatch_metrics",
    "opd_advantages",
    "opsm_mask",
    "pad_rows",
    "ppo_policy_loss",
    "reduce_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
    "sample_mean",
    "sapo_policy_loss",
    "sequence_log_ratio",
    "sft_loss",
    "sum_of_sample_mean",
    "tis_weights",
    "token_mean",
    "value_loss",
    "whiten",
]
