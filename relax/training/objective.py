"""Build the per-micro-batch loss function of the configured algorithm from `relax.algorithms`."""

from __future__ import annotations

from typing import Any

import torch

from relax import algorithms as alg

# Estimators whose loss is plain PPO clipping on per-token ratios.
_PPO_CLIP = {"grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo", "on_policy_distillation"}
SUPPORTED_ESTIMATORS = frozenset(_PPO_CLIP | {"gspo", "sapo", "cispo"})


class PolicyObjective:
    """`loss_fn(logprobs, entropy, batch, mask) -> (loss, metrics)` for `MegatronTrainer.train_step`.

    batch fields used: `advantages` [B,T], `old_logprobs` [B,T] (absent: on-policy, ratio 1 with the
    current log-probs detached), `loss_mask` [B,T].
    """

    def __init__(self, *, estimator: str, eps_clip: float, eps_clip_high: float, eps_clip_c: float | None,
                 entropy_coef: float, per_token_loss: bool, sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05):
        if estimator not in SUPPORTED_ESTIMATORS:
            raise ValueError(f"advantage estimator {estimator!r} has no policy loss here")
        self.estimator = estimator
        self.eps_clip, self.eps_clip_high, self.eps_clip_c = eps_clip, eps_clip_high, eps_clip_c
        self.entropy_coef = entropy_coef
        self.reduction = "token_mean" if per_token_loss else "sample_mean"
        self.sapo = (sapo_tau_pos, sapo_tau_neg)
        self.needs_entropy = True  # reported as train/entropy; cheap next to the forward pass

    @classmethod
    def from_config(cls, config: Any) -> "PolicyObjective":
        return cls(estimator=config.advantage_estimator, eps_clip=config.eps_clip, eps_clip_high=config.eps_clip_high,
                   eps_clip_c=config.eps_clip_c, entropy_coef=config.entropy_coef,
                   per_token_loss=bool(config.calculate_per_token_loss), sapo_tau_pos=config.sapo_tau_pos,
                   sapo_tau_neg=config.sapo_tau_neg)

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: dict[str, torch.Tensor],
                 mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        old = batch.get("old_logprobs")
        if old is None:
            old = logprobs.detach()
        advantages = batch["advantages"]
        if self.estimator in _PPO_CLIP:
            per_token, metrics = alg.ppo_policy_loss(logprobs, old, advantages, mask, eps_clip=self.eps_clip,
                                                     eps_clip_high=self.eps_clip_high, eps_clip_c=self.eps_clip_c)
        elif self.estimator == "gspo":
            per_token, metrics = alg.gspo_policy_loss(logprobs, old, advantages, mask, eps_clip=self.eps_clip,
                                                      eps_clip_high=self.eps_clip_high)
        elif self.estimator == "sapo":
            per_token, metrics = alg.sapo_policy_loss(logprobs, old, advantages, mask, tau_pos=self.sapo[0],
                                                      tau_neg=self.sapo[1])
        else:
            per_token, metrics = alg.cispo_policy_loss(logprobs, old, advantages, mask,
                                                       eps_clip_high=self.eps_clip_high, eps_clip=self.eps_clip)
        loss = alg.reduce_loss(per_token, mask, self.reduction)
        report = {"pg_loss": loss.detach(), **{k: v for k, v in metrics.items()}}
        if entropy is not None:
            ent = alg.reduce_loss(entropy, mask, self.reduction)
            report["entropy"] = ent.detach()
            if self.entropy_coef:
                loss = loss - self.entropy_coef * ent
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite policy loss ({loss.item()}) in a micro-batch")
        return loss, report
