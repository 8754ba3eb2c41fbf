"""Build the per-micro-batch loss function of the configured algorithm from `relax.algorithms`."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from relax import algorithms as alg
from relax.config.validate import load_hook

# Estimators whose loss is plain PPO clipping on per-token ratios.
_PPO_CLIP = {"grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo", "on_policy_distillation"}
SUPPORTED_ESTIMATORS = frozenset(_PPO_CLIP | {"gspo", "sapo", "cispo"})
# How MegatronTrainer.train_step weights each metric across micro-batches (`metric_weighting`): the reduced
# loss terms follow the loss (--calculate-per-token-loss: masked tokens, else samples); these are means over the
# samples that have a masked token; every other metric of relax.algorithms is a masked-token mean.
_REDUCED_METRICS = frozenset({"pg_loss", "entropy", "kl", "sft_loss", "value_loss"})
_SAMPLE_METRICS = frozenset({"seq_ratio_mean", "opsm_seq_fraction", "opsm_seq_kl_mean",
                             "mismatch_seq_abs_log_ratio_mean"})


def _metric_weighting(name: str, loss_weighting: str) -> str:
    if name in _REDUCED_METRICS:
        return loss_weighting
    return "samples" if name in _SAMPLE_METRICS else "tokens"


class PolicyObjective:
    """`loss_fn(logprobs, entropy, batch, mask) -> (loss, metrics)` for `MegatronTrainer.train_step`.

    batch fields used: `advantages` [B,T], `old_logprobs` [B,T] (absent: on-policy, ratio 1 with the
    current log-probs detached), `loss_mask` [B,T], `rollout_logprobs` [B,T] (the engine's; TIS, OPSM,
    mismatch metrics), `ref_logprobs` [B,T] (KL loss), `old_entropy` [B,T] (--use-rollout-entropy: the rollout
    policy's per-token entropy from the log-prob pass; train/entropy, and for custom losses, e.g. entropy-based
    token masks).

    loss = reduce(pg_per_token [* TIS weight] [* OPSM keep]) - entropy_coef * H + kl_loss_coef * KL

    Hooks (dotted paths):
      * custom TIS: `fn(pg_loss, train_logprobs, rollout_logprobs, mask) -> (pg_loss, mask, metrics)`, all
        [B,T] (`train_logprobs` are the trainer's log-probs of the rollout policy); replaces --use-tis;
      * custom pg-loss reducer: `fn(pg_loss [B,T], mask [B,T]) -> scalar` (the policy-gradient term only);
      * custom loss (`--loss-type custom_loss`): `fn(logprobs, entropy, batch, mask) -> (loss, metrics)`,
        the whole micro-batch loss.
    `--loss-type sft`: the loss is the reduced negative log-likelihood of the response tokens.

    reduce = token mean with --calculate-per-token-loss, else sample mean; `loss_weighting` tells the trainer
    to weight micro-batches by their share of the step's masked tokens (samples), so the step's objective is
    the token (sample) mean over the whole step whatever the micro-batch split (`MegatronTrainer.train_step`).
    Metrics across micro-batches (`metric_weighting`): pg_loss, entropy, kl and sft_loss are weighted like the
    loss (the step's token / sample mean); clip fractions, approx_kl and the other masked-token means of
    relax.algorithms (TIS, OPSM token fraction, mismatch means, custom TIS hook metrics) by tokens, so they are
    the step's token means; seq_ratio_mean and the per-sequence OPSM / mismatch metrics by samples.
    mismatch_ratio_min / _max / _std are token-weighted means of the micro-batches' values (not the step's
    extremes). A custom loss (`--loss-type custom_loss`) has all its metrics weighted like its loss.
    """

    def __init__(self, *, estimator: str, eps_clip: float, eps_clip_high: float, eps_clip_c: float | None,
                 entropy_coef: float, per_token_loss: bool, sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05,
                 loss_type: str = "policy_loss", use_kl_loss: bool = False, kl_loss_coef: float = 0.0,
                 kl_loss_type: str = "k1", use_unbiased_kl: bool = False, use_tis: bool = False,
                 tis_clip: float = 2.0, tis_clip_low: float = 0.0, use_opsm: bool = False, opsm_delta: float = 1e-4,
                 get_mismatch_metrics: bool = False, custom_tis: Optional[Callable] = None,
                 custom_reducer: Optional[Callable] = None, custom_loss: Optional[Callable] = None,
                 entropy_from_batch: bool = False):
        if loss_type == "policy_loss" and estimator not in SUPPORTED_ESTIMATORS:
            raise ValueError(f"advantage estimator {estimator!r} has no policy loss here")
        if loss_type == "custom_loss" and custom_loss is None:
            raise ValueError("--loss-type custom_loss needs --custom-loss-function-path")
        self.estimator = estimator
        self.loss_type = loss_type
        self.eps_clip, self.eps_clip_high, self.eps_clip_c = eps_clip, eps_clip_high, eps_clip_c
        self.entropy_coef = entropy_coef
        self.reduction = "token_mean" if per_token_loss else "sample_mean"
        self.loss_weighting = "tokens" if per_token_loss else "samples"  # for dynamic batch sizes
        self.sapo = (sapo_tau_pos, sapo_tau_neg)
        self.use_kl_loss, self.kl_loss_coef, self.kl_loss_type = use_kl_loss, kl_loss_coef, kl_loss_type
        self.use_unbiased_kl = use_unbiased_kl
        self.use_tis, self.tis_clip, self.tis_clip_low = use_tis, tis_clip, tis_clip_low
        self.use_opsm, self.opsm_delta = use_opsm, opsm_delta
        self.get_mismatch_metrics = get_mismatch_metrics
        self.custom_tis, self.custom_reducer, self.custom_loss = custom_tis, custom_reducer, custom_loss
        # reported as train/entropy; cheap next to the forward pass. With --use-rollout-entropy (`entropy_from_batch`)
        # and no entropy bonus, train/entropy is the batch's `old_entropy` (from the log-prob pass) instead.
        self.entropy_from_batch = entropy_from_batch
        self.needs_entropy = not (entropy_from_batch and not entropy_coef)

    @classmethod
    def from_config(cls, config: Any) -> "PolicyObjective":
        return cls(estimator=config.advantage_estimator, eps_clip=config.eps_clip, eps_clip_high=config.eps_clip_high,
                   eps_clip_c=config.eps_clip_c, entropy_coef=config.entropy_coef,
                   per_token_loss=bool(config.calculate_per_token_loss), sapo_tau_pos=config.sapo_tau_pos,
                   sapo_tau_neg=config.sapo_tau_neg, loss_type=config.loss_type, use_kl_loss=bool(config.use_kl_loss),
                   kl_loss_coef=float(config.kl_loss_coef or 0.0), kl_loss_type=config.kl_loss_type,
                   use_unbiased_kl=bool(config.use_unbiased_kl), use_tis=bool(config.use_tis),
                   tis_clip=config.tis_clip, tis_clip_low=config.tis_clip_low or 0.0, use_opsm=bool(config.use_opsm),
                   opsm_delta=config.opsm_delta, get_mismatch_metrics=bool(config.get_mismatch_metrics),
                   custom_tis=load_hook(config.custom_tis_function_path, "--custom-tis-function-path"),
                   custom_reducer=load_hook(config.custom_pg_loss_reducer_function_path,
                                        "--custom-pg-loss-reducer-function-path"),
                   custom_loss=load_hook(config.custom_loss_function_path, "--custom-loss-function-path")
                   if config.loss_type == "custom_loss" else None,
                   entropy_from_batch=bool(config.use_rollout_entropy))

    @property
    def needs_ref(self) -> bool:
        return self.use_kl_loss

    def metric_weighting(self, name: str) -> str:
        if self.loss_type == "custom_loss":
            return self.loss_weighting
        return _metric_weighting(name, self.loss_weighting)

    def _policy_loss(self, logprobs, old, advantages, mask):
        if self.estimator in _PPO_CLIP:
            return alg.ppo_policy_loss(logprobs, old, advantages, mask, eps_clip=self.eps_clip,
                                       eps_clip_high=self.eps_clip_high, eps_clip_c=self.eps_clip_c)
        if self.estimator == "gspo":
            return alg.gspo_policy_loss(logprobs, old, advantages, mask, eps_clip=self.eps_clip,
                                        eps_clip_high=self.eps_clip_high)
        if self.estimator == "sapo":
            return alg.sapo_policy_loss(logprobs, old, advantages, mask, tau_pos=self.sapo[0], tau_neg=self.sapo[1])
        return alg.cispo_policy_loss(logprobs, old, advantages, mask, eps_clip_high=self.eps_clip_high,
                                     eps_clip=self.eps_clip)

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: dict[str, torch.Tensor],
                 mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        if self.loss_type == "custom_loss":
            return self.custom_loss(logprobs, entropy, batch, mask)
        old = batch.get("old_logprobs")
        if old is None:
            old = logprobs.detach()
        report: dict[str, Any] = {}
        if self.loss_type == "sft":
            loss = alg.reduce_loss(alg.sft_loss(logprobs, mask), mask, self.reduction)
            report["sft_loss"] = loss.detach()
        else:
            per_token, metrics = self._policy_loss(logprobs, old, batch["advantages"], mask)
            report.update(metrics)
            pg_mask = mask
            rollout = batch.get("rollout_logprobs")
            needs_rollout = self.use_opsm or self.use_tis or self.custom_tis or self.get_mismatch_metrics
            if needs_rollout and rollout is None:
                raise ValueError("TIS / OPSM / mismatch metrics need the engine's log-probs (rollout_logprobs)")
            if self.get_mismatch_metrics:
                for key, value in alg.mismatch_metrics(old.detach(), rollout, mask).items():
                    report[f"mismatch_{key}"] = value
            if self.use_opsm:
                keep, metrics = alg.opsm_mask(logprobs, rollout, batch["advantages"], mask, delta=self.opsm_delta)
                per_token = per_token * keep
                report.update(metrics)
            if self.custom_tis is not None:
                per_token, pg_mask, metrics = self.custom_tis(per_token, old.detach(), rollout, pg_mask)
                report.update({f"tis_{k}" if not k.startswith("tis") else k: v for k, v in (metrics or {}).items()})
            elif self.use_tis:
                weights, metrics = alg.tis_weights(old.detach(), rollout, mask, self.tis_clip, self.tis_clip_low)
                per_token = per_token * weights
                report.update(metrics)
            if self.custom_reducer is not None:
                loss = self.custom_reducer(per_token, pg_mask)
            else:
                loss = alg.reduce_loss(per_token, pg_mask, self.reduction)
            report["pg_loss"] = loss.detach()
        if entropy is not None:
            ent = alg.reduce_loss(entropy, mask, self.reduction)
            report["entropy"] = ent.detach()
            if self.entropy_coef:
                loss = loss - self.entropy_coef * ent
        elif self.entropy_from_batch and batch.get("old_entropy") is not None:
            report["entropy"] = alg.reduce_loss(batch["old_entropy"], mask, self.reduction).detach()
        if self.use_kl_loss:
            ref = batch.get("ref_logprobs")
            if ref is None:
                raise ValueError("--use-kl-loss needs the reference model's log-probs (ref_logprobs)")
            kl = alg.kl_estimate(logprobs, ref, self.kl_loss_type, mask=mask, unbiased=self.use_unbiased_kl,
                                 old_logprobs=old)
            kl_term = alg.reduce_loss(kl, mask, self.reduction)
            report["kl"] = kl_term.detach()
            if self.kl_loss_coef:
                loss = loss + self.kl_loss_coef * kl_term
        # A non-finite loss is not raised here (one rank raising inside a collective would hang the others):
        # MegatronTrainer.train_step checks the reduced loss and the gradients on every rank.
        return loss, report


class ValueObjective:
    """The critic's loss for `MegatronTrainer.train_step` on a value-head model (`values` arrive in place of
    log-probs): the PPO clipped value loss `relax.algorithms.value_loss` against batch `returns`, clipped
    around batch `old_values` (the critic's values when the step's samples were scored) by `--value-clip`,
    reduced like the policy loss (`--calculate-per-token-loss`: token mean, else sample mean).

    Metrics: value_loss (weighted like the loss: the step's token / sample mean), values_mean (current values)
    and clip_fraction (tokens whose clipped branch is active), both the step's masked-token means."""

    needs_entropy = False

    def __init__(self, *, value_clip: float | None, per_token_loss: bool):
        self.value_clip = value_clip
        self.reduction = "token_mean" if per_token_loss else "sample_mean"
        self.loss_weighting = "tokens" if per_token_loss else "samples"

    def metric_weighting(self, name: str) -> str:
        return _metric_weighting(name, self.loss_weighting)

    @classmethod
    def from_config(cls, config: Any) -> "ValueObjective":
        return cls(value_clip=config.value_clip, per_token_loss=bool(config.calculate_per_token_loss))

    def __call__(self, values: torch.Tensor, entropy: torch.Tensor | None, batch: dict[str, torch.Tensor],
                 mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        per_token, metrics = alg.value_loss(values, batch["old_values"], batch["returns"], mask,
                                            value_clip=self.value_clip)
        loss = alg.reduce_loss(per_token, mask, self.reduction)
        count = mask.sum().clamp_min(1)
        return loss, {"value_loss": loss.detach(), "values_mean": ((values.detach() * mask).sum() / count),
                      "clip_fraction": metrics["clip_fraction"]}
