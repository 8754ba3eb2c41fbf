"""Per-sample advantages of one rollout step, from its samples' rewards and groups."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from relax import algorithms as alg
from relax.data.sample import Sample

GROUP_ESTIMATORS = {"grpo", "gspo", "sapo", "cispo", "on_policy_distillation"}


def sample_advantages(samples: Sequence[Sample], config: Any) -> torch.Tensor:
    """One advantage per sample ([B] float32), broadcast later over its response tokens."""
    rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
    groups = torch.tensor([int(s.group_index) for s in samples], dtype=torch.long)
    est = config.advantage_estimator
    if config.disable_rewards_normalization:
        adv = rewards.clone()
    elif est in GROUP_ESTIMATORS:
        adv = alg.grpo_advantages(rewards, groups, normalize_std=not config.disable_grpo_std_normalization)
    elif est == "rloo":
        adv = alg.rloo_advantages(rewards, groups)
    else:
        raise ValueError(f"advantage estimator {est!r} is not wired into the training loop yet")
    if config.normalize_advantages:
        adv = alg.whiten(adv)
    return adv.float()


def trainer_inputs(samples: Sequence[Sample], advantages: torch.Tensor) -> list[dict[str, Any]]:
    """`MegatronTrainer` sample dicts: tokens, response_length and per-response-token fields."""
    out = []
    for sample, adv in zip(samples, advantages.tolist()):
        n = len(sample.response_tokens)
        out.append({
            "tokens": torch.tensor(sample.prompt_tokens + sample.response_tokens, dtype=torch.long),
            "response_length": n,
            "advantages": torch.full((n,), float(adv), dtype=torch.float32),
            "loss_mask": torch.tensor(sample.loss_mask or [1] * n, dtype=torch.float32),
            "rollout_logprobs": torch.tensor(sample.response_logprobs, dtype=torch.float32),
        })
    return out
