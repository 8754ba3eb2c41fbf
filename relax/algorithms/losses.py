"""Policy/value/SFT losses and loss reducers.

Conventions: per-token inputs are ``[B, T]`` with a ``mask [B, T]`` (nonzero = token
counts in the loss); ``advantages`` may be ``[B, T]`` or per-sample ``[B]`` (broadcast
over tokens). Every ``*_loss`` returns a **per-token loss** ``[B, T]`` to be *minimized*
(exactly 0 outside the mask; padding garbage cannot leak NaN into values or gradients),
which you then reduce with ``token_mean`` / ``sample_mean`` / ``sum_of_sample_mean`` (or
``reduce_loss``). Policy losses also return a ``metrics`` dict of detached 0-dim tensors
(token means over the mask; 0 for an empty mask) so callers can log without a host sync.
Computation is done in at least float32.

Notation: ``r_t = exp(logprobs_t - old_logprobs_t)`` is the token importance ratio,
``A_t`` the advantage, ``eps_low = eps_clip``, ``eps_high = eps_clip_high`` (defaults to
``eps_clip``), ``sg`` = stop-gradient.
"""

from __future__ import annotations

import torch

from ._utils import as_mask, float_dtype, per_token, zero_outside

__all__ = [
    "REDUCTIONS",
    "token_mean",
    "sample_mean",
    "sum_of_sample_mean",
    "reduce_loss",
    "ppo_policy_loss",
    "gspo_policy_loss",
    "sapo_policy_loss",
    "cispo_policy_loss",
    "entropy_from_logits",
    "entropy_bonus_loss",
    "value_loss",
    "sft_loss",
]

REDUCTIONS = ("token_mean", "sample_mean", "sum_of_sample_mean")


# --------------------------------------------------------------------------------------
# reducers
# --------------------------------------------------------------------------------------


def token_mean(x: torch.Tensor, mask: torch.Tensor, *, num_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """Mean over all masked tokens of the batch (``--calculate-per-token-loss``).

    ``sum_{b,t} x[b,t] * m[b,t] / max(N, 1)`` with ``N = sum(m)`` or the given
    ``num_tokens`` (e.g. a global token count across micro-batches / DP ranks). An empty
    mask gives 0 (still attached to the graph of ``x``).
    """
    bool_mask, _ = as_mask(mask, x)
    total = zero_outside(x, bool_mask).sum()
    n = bool_mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=x.device)
    return total / n.to(total.dtype).clamp_min(1)


def _per_sample_means(x: torch.Tensor, bool_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    counts = bool_mask.sum(dim=-1)
    sums = zero_outside(x, bool_mask).sum(dim=-1)
    return sums / counts.to(sums.dtype).clamp_min(1), counts


def sample_mean(x: torch.Tensor, mask: torch.Tensor, *, num_samples: float | torch.Tensor | None = None) -> torch.Tensor:
    """Mean over each sample's masked tokens, then mean over samples.

    ``(1/S) * sum_b [ sum_t x[b,t] m[b,t] / max(n_b, 1) ]`` with ``n_b = sum_t m[b,t]`` and
    ``S`` = the number of samples with ``n_b > 0`` (at least 1), or the given
    ``num_samples`` (e.g. the global batch size). Zero-token samples contribute 0.
    """
    bool_mask, _ = as_mask(mask, x)
    means, counts = _per_sample_means(x, bool_mask)
    s = (counts > 0).sum() if num_samples is None else torch.as_tensor(num_samples, device=x.device)
    return means.sum() / s.to(means.dtype).clamp_min(1)


def sum_of_sample_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over samples of each sample's token mean: ``sum_b sum_t x m / max(n_b, 1)``.

    (slime's ``sum_of_sample_mean``; divide by a global batch size yourself.) Zero-token
    samples contribute 0.
    """
    bool_mask, _ = as_mask(mask, x)
    means, _ = _per_sample_means(x, bool_mask)
    return means.sum()


def reduce_loss(x: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean") -> torch.Tensor:
    """Dispatch to ``token_mean`` / ``sample_mean`` / ``sum_of_sample_mean`` by name."""
    if mode == "token_mean":
        return token_mean(x, mask)
    if mode == "sample_mean":
        return sample_mean(x, mask)
    if mode == "sum_of_sample_mean":
        return sum_of_sample_mean(x, mask)
    raise ValueError(f"unknown reduction {mode!r}; expected one of {REDUCTIONS}")


# --------------------------------------------------------------------------------------
# shared preparation
# --------------------------------------------------------------------------------------


def _prepare(logprobs, old_logprobs, advantages, mask):
    dtype = float_dtype(logprobs, old_logprobs, advantages)
    bool_mask, _ = as_mask(mask, logprobs)
    lp = zero_outside(logprobs.to(dtype), bool_mask)
    old = zero_outside(old_logprobs.to(dtype), bool_mask)
    adv = zero_outside(per_token(advantages.to(dtype), lp), bool_mask)
    return lp, old, adv, bool_mask


def _mean_metric(x: torch.Tensor, bool_mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        x = x.detach().to(torch.float32) if x.dtype != torch.float64 else x.detach()
        return zero_outside(x, bool_mask).sum() / bool_mask.sum().to(x.dtype).clamp_min(1)


# --------------------------------------------------------------------------------------
# policy losses
# --------------------------------------------------------------------------------------


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip (DAPO "clip-higher")
    and optional dual clip (Ye et al. 2020, arXiv:1912.09729), per token.

    ::

        L1 = -A * r
        L2 = -A * clip(r, 1 - eps_low, 1 + eps_high)
        L  = max(L1, L2)                       # = -min(r A, clip(r) A)
        if eps_clip_c is not None (must be > 1):
            L = min(L, -eps_clip_c * A)   where A < 0   (= min(L, c |A|))
                L                         where A >= 0

    The dual clip bounds the loss of a negative-advantage token by ``c*|A|`` when the ratio
    is very large (then the token gives no gradient). Metrics (token means over the mask):
    ``clip_fraction`` = frac(L2 > L1), ``dual_clip_fraction`` = frac(A < 0 and the
    ``c*|A|`` bound is active; 0 without dual clip), ``approx_kl`` = mean(old_logprobs -
    logprobs) (k1 estimate of KL(old || new)).

    With ``old_logprobs == logprobs`` (no clipping active) the gradient is
    ``dL/dlogprobs = -A``.
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    if eps_clip_c is not None and eps_clip_c <= 1.0:
        raise ValueError(f"eps_clip_c must be > 1 for dual-clip PPO, got {eps_clip_c}")
    lp, old, adv, bool_mask = _prepare(logprobs, old_logprobs, advantages, mask)
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(loss1, loss2)
    clipped = loss2 > loss1
    dual = torch.zeros_like(clipped)
    if eps_clip_c is not None:
        bound = -eps_clip_c * adv
        neg = adv < 0
        dual = neg & (loss > bound)
        loss = torch.where(neg, torch.minimum(loss, bound), loss)
    loss = zero_outside(loss, bool_mask)
    metrics = {
        "clip_fraction": _mean_metric(clipped.to(lp.dtype), bool_mask),
        "dual_clip_fraction": _mean_metric(dual.to(lp.dtype), bool_mask),
        "approx_kl": _mean_metric(-log_ratio, bool_mask),
    }
    return loss, metrics


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO, token-level gradient form "GSPO-token" (Zheng et al., arXiv:2507.18071, eq. 13-14).

    ::

        log s_b  = (1/|y_b|) * sum_t m[b,t] * (logprobs - old_logprobs)[b,t]   # seq ratio
        s_{b,t}  = sg(s_b) * pi(y_t) / sg(pi(y_t))
                 = exp(sg(log s_b) + logprobs[b,t] - sg(logprobs[b,t]))        # value == s_b
        L[b,t]   = max(-A[b,t] * s_{b,t}, -A[b,t] * clip(s_{b,t}, 1 - eps_low, 1 + eps_high))

    Clipping is decided per *sequence* (all tokens of a sample share ``s_b``). The gradient
    of an unclipped token is ``-A[b,t] * s_b * d logprobs[b,t]``; with a per-sample
    advantage and ``sample_mean`` reduction this equals the sequence-level GSPO gradient
    ``-A_b * d s_b``. ``|y_b|`` is clamped to >= 1 (zero-token samples give 0 loss).
    Paper-scale clip ranges are small (e.g. 3e-4 / 4e-4).

    Metrics: ``clip_fraction`` (fraction of masked tokens whose sequence is clipped),
    ``approx_kl`` = mean(old - new) over tokens, ``seq_ratio_mean`` (mean of ``s_b`` over
    samples with tokens).
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    lp, old, adv, bool_mask = _prepare(logprobs, old_logprobs, advantages, mask)
    log_ratio = lp - old
    counts = bool_mask.sum(dim=-1)
    seq_log_ratio = zero_outside(log_ratio, bool_mask).sum(dim=-1) / counts.to(lp.dtype).clamp_min(1)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + lp - lp.detach()
    s = torch.exp(token_log_ratio)
    loss1 = -adv * s
    loss2 = -adv * s.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = zero_outside(torch.maximum(loss1, loss2), bool_mask)
    clipped = loss2 > loss1
    with torch.no_grad():
        has = counts > 0
        seq_ratio_mean = (torch.exp(seq_log_ratio) * has).sum() / has.sum().clamp_min(1)
    metrics = {
        "clip_fraction": _mean_metric(clipped.to(lp.dtype), bool_mask),
        "approx_kl": _mean_metric(-log_ratio, bool_mask),
        "seq_ratio_mean": seq_ratio_mean.detach(),
    }
    return loss, metrics


def sapo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO, Soft Adaptive Policy Optimization (Gao et al., arXiv:2511.20347).

    Replaces the hard clip with a temperature-controlled sigmoid gate on the token ratio::

        tau_t = tau_pos if A_t > 0 else tau_neg
        f(r)  = (4 / tau_t) * sigmoid(tau_t * (r_t - 1))
        L_t   = -f(r_t) * A_t

    ``df/dr = 4 * s * (1 - s)`` with ``s = sigmoid(tau (r - 1))``, which is 1 at ``r = 1``
    (on-policy gradient equals plain policy gradient ``-A d logp``) and decays smoothly as
    ``r`` leaves 1; larger tau decays faster (paper defaults tau_pos=1.0, tau_neg=1.05).

    Metrics: ``gate_weight_mean`` = mean of ``4 s (1 - s)``, ``soft_clip_fraction`` =
    frac(gate weight < 0.5), ``approx_kl`` = mean(old - new).
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError("tau_pos and tau_neg must be > 0")
    lp, old, adv, bool_mask = _prepare(logprobs, old_logprobs, advantages, mask)
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    sig = torch.sigmoid(tau * (ratio - 1.0))
    gate = (4.0 / tau) * sig
    loss = zero_outside(-gate * adv, bool_mask)
    with torch.no_grad():
        weight = 4.0 * sig * (1.0 - sig)
    metrics = {
        "gate_weight_mean": _mean_metric(weight, bool_mask),
        "soft_clip_fraction": _mean_metric((weight < 0.5).to(lp.dtype), bool_mask),
        "approx_kl": _mean_metric(-log_ratio, bool_mask),
    }
    return loss, metrics


def cispo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip_high: float,
    eps_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO, clipped IS-weight policy optimization (MiniMax-M1, arXiv:2506.13585, eq. 4-5).

    ::

        w_t = sg(clip(r_t, 1 - eps_low, 1 + eps_high))
        L_t = -w_t * A_t * logprobs_t

    The IS weight is truncated under stop-gradient, so every token keeps a gradient
    (``dL/dlogprobs = -w A``), unlike PPO where clipped tokens get none. ``eps_clip=None``
    disables the lower bound (the paper's setting); ``eps_clip_high`` is the upper bound.

    Metrics: ``clip_fraction`` = frac(w != r), ``approx_kl`` = mean(old - new).
    """
    lp, old, adv, bool_mask = _prepare(logprobs, old_logprobs, advantages, mask)
    log_ratio = lp - old
    ratio = torch.exp(log_ratio).detach()
    lower = None if eps_clip is None else 1.0 - eps_clip
    w = ratio.clamp(min=lower, max=1.0 + eps_clip_high)
    loss = zero_outside(-w * adv * lp, bool_mask)
    metrics = {
        "clip_fraction": _mean_metric((w != ratio).to(lp.dtype), bool_mask),
        "approx_kl": _mean_metric(-log_ratio, bool_mask),
    }
    return loss, metrics


# --------------------------------------------------------------------------------------
# entropy, value, SFT
# --------------------------------------------------------------------------------------


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``H = -sum_v p_v log p_v``.

    ``logits [..., V] -> [...]``. Computed in at least float32 via ``log_softmax``;
    ``-inf`` logits (banned tokens) contribute exactly 0 to value and gradient.
    """
    dtype = float_dtype(logits)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    p = logp.exp()
    safe_logp = torch.where(torch.isfinite(logp), logp, torch.zeros((), dtype=dtype, device=logp.device))
    return -(p * safe_logp).sum(dim=-1)


def entropy_bonus_loss(
    entropy: torch.Tensor, mask: torch.Tensor, coef: float, *, mode: str = "token_mean"
) -> torch.Tensor:
    """Entropy bonus as a loss term to *add*: ``-coef * reduce(entropy, mask, mode)`` (scalar)."""
    return -coef * reduce_loss(entropy, mask, mode)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss, per token.

    ::

        V_clip = clip(values, old_values - value_clip, old_values + value_clip)
        L      = 0.5 * max((values - R)^2, (V_clip - R)^2)

    (``value_clip=None``: ``L = 0.5 * (values - R)^2``.) Metrics: ``clip_fraction`` =
    frac((V_clip - R)^2 > (values - R)^2): the tokens whose clipped branch of the max is taken.
    ``values`` is clipped into the interval itself (as verl's ``clip_by_value``), so an unclipped
    token has ``V_clip == values`` exactly and never counts; ``old_values + clip(values -
    old_values, ...)`` could differ from ``values`` by a rounding step and count spuriously.
    """
    dtype = float_dtype(values, old_values, returns)
    bool_mask, _ = as_mask(mask, values)
    v = zero_outside(values.to(dtype), bool_mask)
    ov = zero_outside(old_values.to(dtype), bool_mask)
    ret = zero_outside(returns.to(dtype), bool_mask)
    l1 = (v - ret) ** 2
    if value_clip is None:
        loss = 0.5 * l1
        clipped = torch.zeros_like(bool_mask)
    else:
        v_clip = torch.clamp(v, ov - value_clip, ov + value_clip)
        l2 = (v_clip - ret) ** 2
        loss = 0.5 * torch.maximum(l1, l2)
        clipped = l2 > l1
    loss = zero_outside(loss, bool_mask)
    return loss, {"clip_fraction": _mean_metric(clipped.to(dtype), bool_mask)}


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood ``-logprobs * mask`` (``[B, T]``); reduce it with
    ``token_mean`` / ``sample_mean``."""
    dtype = float_dtype(logprobs)
    bool_mask, _ = as_mask(mask, logprobs)
    return zero_outside(-logprobs.to(dtype), bool_mask)
