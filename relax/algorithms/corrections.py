"""Off-policy / train-inference mismatch corrections.

``train_logprobs`` are log-probs recomputed by the training engine (old policy, or the
current one), ``rollout_logprobs`` are the log-probs reported by the inference engine that
sampled the tokens. Both ``[B, T]`` with a ``mask [B, T]``. All outputs are detached
(corrections are constants in the loss), exactly 0 outside the mask, and NaN-free for
empty masks.
"""

from __future__ import annotations

import torch

from ._utils import as_mask, float_dtype, per_token, zero_outside

__all__ = ["tis_weights", "sequence_log_ratio", "opsm_mask", "mismatch_metrics"]


def _mean(x: torch.Tensor, bool_mask: torch.Tensor) -> torch.Tensor:
    return zero_outside(x, bool_mask).sum() / bool_mask.sum().to(x.dtype).clamp_min(1)


@torch.no_grad()
def tis_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 2.0,
    clip_low: float = 0.0,
    *,
    mode: str = "truncate",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling weights for the train/rollout mismatch (per token).

    ``rho_t = exp(train_logprobs_t - rollout_logprobs_t)`` and

    * ``mode="truncate"`` (TIS, Yao et al. 2025 "Your efficient RL framework secretly brings
      you off-policy RL training"; slime ``vanilla_tis_function``):
      ``w_t = clamp(rho_t, clip_low, clip)``;
    * ``mode="mask"`` (IcePop-style token masking): ``w_t = rho_t`` if
      ``clip_low <= rho_t <= clip`` else 0.

    Use as ``pg_loss_per_token * w`` before reducing. Returns ``(w [B, T], metrics)`` with
    ``w`` detached and 0 outside the mask; metrics (token means): ``tis_clip_fraction`` =
    frac(rho outside [clip_low, clip]), ``tis_weight_mean`` = mean(w), ``tis_ratio_mean`` =
    mean(rho).
    """
    if mode not in ("truncate", "mask"):
        raise ValueError(f"unknown TIS mode {mode!r}; expected 'truncate' or 'mask'")
    if clip_low > clip:
        raise ValueError(f"clip_low ({clip_low}) must be <= clip ({clip})")
    dtype = float_dtype(train_logprobs, rollout_logprobs)
    bool_mask, _ = as_mask(mask, train_logprobs)
    lr = zero_outside(train_logprobs.to(dtype) - rollout_logprobs.to(dtype), bool_mask)
    rho = torch.exp(lr)
    outside = (rho < clip_low) | (rho > clip)
    if mode == "truncate":
        w = rho.clamp(clip_low, clip)
    else:
        w = torch.where(outside, torch.zeros_like(rho), rho)
    w = zero_outside(w, bool_mask)
    metrics = {
        "tis_clip_fraction": _mean(outside.to(dtype), bool_mask),
        "tis_weight_mean": _mean(w, bool_mask),
        "tis_ratio_mean": _mean(rho, bool_mask),
    }
    return w, metrics


@torch.no_grad()
def sequence_log_ratio(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sample mean log-ratio ``(1/max(n_b,1)) * sum_t m (logprobs - ref_logprobs)`` (``[B]``)."""
    dtype = float_dtype(logprobs, ref_logprobs)
    bool_mask, _ = as_mask(mask, logprobs)
    d = zero_outside(logprobs.to(dtype) - ref_logprobs.to(dtype), bool_mask)
    return d.sum(dim=-1) / bool_mask.sum(dim=-1).to(dtype).clamp_min(1)


@torch.no_grad()
def opsm_mask(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    delta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Off-Policy Sequence Masking (DeepSeek-V3.2, arXiv:2512.02556, Sec. "Off-Policy Sequence Masking").

    ::

        D_b   = (1/|y_b|) * sum_t m[b,t] * (rollout_logprobs - logprobs)[b,t]
              # = mean_t log(pi_old / pi_theta): sequence-level (k1) KL(pi_old || pi_theta)
        M[b,t] = 0  if A[b,t] < 0 and D_b > delta
                 1  otherwise

    i.e. negative-advantage samples that have drifted too far off-policy are dropped; the
    model keeps learning from its positive and near-on-policy samples. ``rollout_logprobs``
    are the behaviour policy's (``pi_old``; inference-engine log-probs), ``logprobs`` the
    current policy's (used detached). ``advantages`` may be ``[B]`` or ``[B, T]`` (the sign
    test is per token, matching slime's ``compute_opsm_mask``).

    Returns ``(keep [B, T], metrics)``: ``keep = M * mask`` as a float tensor. Multiply the
    per-token policy loss by ``keep`` but reduce with the *original* mask: in the paper M
    sits inside ``1/|o_i| sum_t``, so masked tokens keep counting in the denominator.
    Metrics: ``opsm_token_fraction`` (masked fraction of tokens), ``opsm_seq_fraction``
    (fraction of samples with tokens that have any masked token), ``opsm_seq_kl_mean``.
    """
    dtype = float_dtype(logprobs, rollout_logprobs, advantages)
    bool_mask, _ = as_mask(mask, logprobs)
    seq_kl = sequence_log_ratio(rollout_logprobs.to(dtype), logprobs.detach().to(dtype), bool_mask)
    adv = per_token(advantages.to(dtype), logprobs.to(dtype))
    drop = (adv < 0) & (seq_kl > delta).unsqueeze(-1) & bool_mask
    keep = (bool_mask & ~drop).to(dtype)
    has = bool_mask.any(dim=-1)
    metrics = {
        "opsm_token_fraction": _mean(drop.to(dtype), bool_mask),
        "opsm_seq_fraction": (drop.any(dim=-1) & has).sum().to(dtype) / has.sum().to(dtype).clamp_min(1),
        "opsm_seq_kl_mean": (seq_kl * has).sum() / has.sum().to(dtype).clamp_min(1),
    }
    return keep, metrics


@torch.no_grad()
def mismatch_metrics(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Train-vs-rollout log-prob mismatch statistics over masked tokens (detached 0-dim tensors).

    With ``d_t = train_logprobs_t - rollout_logprobs_t`` and ``rho_t = exp(d_t)``:

    * ``logprob_abs_diff_mean`` = mean |d|
    * ``k1_kl`` = mean(-d)   (k1 estimate of KL(pi_rollout || pi_train), tokens ~ rollout)
    * ``k3_kl`` = mean(rho - 1 - d)   (k3 estimate of the same KL; >= 0)
    * ``ratio_mean`` / ``ratio_std`` (population) / ``ratio_min`` / ``ratio_max`` of rho
    * ``seq_abs_log_ratio_mean`` = mean over samples (with tokens) of |mean_t d|

    An empty mask gives 0 for all diff/KL/std metrics and 1 for ratio mean/min/max.
    """
    dtype = float_dtype(train_logprobs, rollout_logprobs)
    bool_mask, _ = as_mask(mask, train_logprobs)
    d = zero_outside(train_logprobs.to(dtype) - rollout_logprobs.to(dtype), bool_mask)
    rho = torch.exp(d)  # == 1 outside the mask
    n = bool_mask.sum()
    ratio_mean = torch.where(n > 0, _mean(rho, bool_mask), torch.ones((), dtype=dtype, device=d.device))
    ratio_var = _mean((rho - ratio_mean) ** 2, bool_mask)
    inf = torch.tensor(float("inf"), dtype=dtype, device=d.device)
    ratio_min = torch.where(bool_mask, rho, inf).amin() if rho.numel() else inf
    ratio_max = torch.where(bool_mask, rho, -inf).amax() if rho.numel() else -inf
    one = torch.ones((), dtype=dtype, device=d.device)
    ratio_min = torch.where(n > 0, ratio_min, one)
    ratio_max = torch.where(n > 0, ratio_max, one)
    has = bool_mask.any(dim=-1)
    seq = sequence_log_ratio(train_logprobs, rollout_logprobs, bool_mask).to(dtype)
    return {
        "logprob_abs_diff_mean": _mean(d.abs(), bool_mask),
        "k1_kl": _mean(-d, bool_mask),
        "k3_kl": _mean(torch.expm1(d) - d, bool_mask),
        "ratio_mean": ratio_mean,
        "ratio_std": ratio_var.sqrt(),
        "ratio_min": ratio_min,
        "ratio_max": ratio_max,
        "seq_abs_log_ratio_mean": (seq.abs() * has).sum() / has.sum().to(dtype).clamp_min(1),
    }
