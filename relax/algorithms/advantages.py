"""Advantage estimators and reward shaping for RL post-training.

Conventions (shared by every function here):

* per-token tensors are right- or arbitrarily-padded ``[B, T]`` floats with a ``mask``
  ``[B, T]`` (bool/int/float; nonzero = response token that counts in the loss);
* per-sample tensors are ``[B]``;
* groups are given as ``group_ids [B]`` (any integer ids, need not be contiguous or sorted;
  samples answering the same prompt share an id; a group may have any size, including 1);
* outputs are exactly 0 outside the mask, never NaN for empty masks / singleton groups;
* every function runs under ``torch.no_grad()``: advantages are constants for the loss;
* group statistics are accumulated in float64; results come back as float32 (float64 if
  an input was float64).

Positions whose mask is 0 *inside* a response (e.g. tool/environment tokens in multi-turn
rollouts) are skipped by the recursive estimators: they receive no reward, apply no
discount and carry the running return/value through unchanged. For right padding this is
identical to the usual "recurse over every position" implementations.

KL reward shaping (``--kl-coef``, ``kl`` a per-token estimate of KL(pi_rollout || pi_ref)) is applied
to the reward *before* the advantage: per-sample estimators see the sequence-shaped reward
``r_b - kl_coef * sum_t KL[b, t] * m[b, t]`` (``kl_shaped_rewards``; group normalisation, RLOO and
REINFORCE++-baseline's group centring act on it); token-level estimators (REINFORCE++, PPO's GAE)
get ``-kl_coef * KL[b, t]`` as a per-token reward with the sample reward on the last token
(``kl_penalized_token_rewards``), so the penalty enters their returns.
"""

from __future__ import annotations

import torch

from ._utils import as_mask, float_dtype, zero_outside

__all__ = [
    "grpo_advantages",
    "rloo_advantages",
    "group_mean_baseline",
    "broadcast_to_tokens",
    "whiten",
    "kl_penalized_token_rewards",
    "kl_shaped_rewards",
    "discounted_returns",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "gae_advantages",
    "opd_advantages",
]


# --------------------------------------------------------------------------------------
# group statistics
# --------------------------------------------------------------------------------------


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    """Per-sample (count, mean, unbiased std) of the sample's group, in float64.

    std uses Bessel's correction (n - 1), as ``torch.std``; it is defined as 0 for
    groups of size 1.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be [B]; got {tuple(rewards.shape)}, {tuple(group_ids.shape)}")
    r = rewards.to(torch.float64)
    if r.numel() == 0:
        return r.clone(), r.clone(), r.clone(), r.clone()
    _, inv = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inv.max().item()) + 1
    counts = torch.bincount(inv, minlength=num_groups).to(torch.float64)
    sums = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, inv, r)
    mean = sums / counts
    centered = r - mean[inv]
    sq = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, inv, centered * centered)
    var = sq / (counts - 1).clamp_min(1)
    std = torch.where(counts > 1, var.sqrt(), torch.zeros_like(var))
    return counts[inv], mean[inv], std[inv], centered


def _out_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return float_dtype(*tensors)


@torch.no_grad()
def group_mean_baseline(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Reward minus its group mean: ``A_i = r_i - mean_{j in g(i)} r_j``  (``[B]``).

    Singleton groups give 0. This is Dr.GRPO's advantage and REINFORCE++-baseline's first
    step.
    """
    _, _, _, centered = _group_stats(rewards, group_ids)
    return centered.to(_out_dtype(rewards))


@torch.no_grad()
def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO group-relative advantage (per sample, ``[B]``).

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` when ``normalize_std`` (GRPO,
    DeepSeekMath arXiv:2402.03300; GSPO uses the same advantage), else
    ``A_i = r_i - mean_g(r)`` (Dr.GRPO, arXiv:2503.20783).

    ``mean_g``/``std_g`` are over the sample's group ``g = group_ids[i]``; ``std_g`` is the
    unbiased (n-1) standard deviation, i.e. ``torch.std`` as in DeepSeekMath/verl/slime.
    Singleton groups have std 0 and centered reward 0, so ``A = 0``; groups whose rewards
    are all equal give exactly 0. Empty input gives an empty output.
    """
    _, _, std, centered = _group_stats(rewards, group_ids)
    adv = centered / (std + eps) if normalize_std else centered
    return adv.to(_out_dtype(rewards))


@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out advantage (per sample, ``[B]``; Ahmadian et al. 2024).

    ``A_i = r_i - (1/(n-1)) * sum_{j in g(i), j != i} r_j = n/(n-1) * (r_i - mean_g(r))``
    with ``n`` the group size. Singleton groups (no other sample) give 0.
    """
    counts, _, _, centered = _group_stats(rewards, group_ids)
    adv = torch.where(counts > 1, centered * counts / (counts - 1).clamp_min(1), torch.zeros_like(centered))
    return adv.to(_out_dtype(rewards))


# --------------------------------------------------------------------------------------
# token-level helpers
# --------------------------------------------------------------------------------------


@torch.no_grad()
def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sample ``[B]`` advantage over its response tokens: ``A[b, t] = A[b] * mask[b, t]``.

    Returns ``[B, T]``, 0 outside the mask.
    """
    dtype = _out_dtype(advantages)
    bool_mask, _ = as_mask(mask, advantages)
    out = advantages.to(dtype).unsqueeze(-1).expand(bool_mask.shape)
    return zero_outside(out, bool_mask)


@torch.no_grad()
def whiten(
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Masked whitening over all masked entries of the batch (``--normalize-advantages``).

    ``n = sum(m)``, ``mu = sum(x*m)/n``, ``var = sum((x-mu)^2 * m)/(n - 1)`` (the unbiased
    variance, as verl's ``masked_whiten`` and OpenRLHF's advantage normalisation),
    ``out = (x - mu) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is added back:
    ``out = (x - mu) / sqrt(var + eps) + mu`` (rescale only). Outside the mask the output
    is 0. An empty mask gives all zeros, a single entry 0 (``n - 1`` is taken as at least 1).
    ``mask=None`` whitens every entry.
    """
    dtype = _out_dtype(values)
    x = values.to(dtype)
    if mask is None:
        mask = torch.ones_like(x, dtype=torch.bool)
    bool_mask, m = as_mask(mask, x)
    # An empty mask gives mu = var = 0 and hence an all-zero output (no host sync needed).
    n = m.to(torch.float64).sum().clamp_min(1)
    x64 = zero_outside(x.to(torch.float64), bool_mask)
    mu = x64.sum() / n
    var = zero_outside((x64 - mu) ** 2, bool_mask).sum() / (n - 1).clamp_min(1)
    out = (x64 - mu) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mu
    return zero_outside(out, bool_mask).to(dtype)


def _last_token_index(bool_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the last masked position per row, and whether the row has any."""
    T = bool_mask.shape[-1]  # callers guarantee T > 0
    pos = torch.arange(T, device=bool_mask.device).expand(bool_mask.shape)
    last = torch.where(bool_mask, pos, torch.full_like(pos, -1)).max(dim=-1).values
    has = last >= 0
    return last.clamp_min(0), has


@torch.no_grad()
def kl_penalized_token_rewards(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Token-level rewards with a KL penalty (``--kl-coef`` reward shaping).

    ``r_tok[b, t] = -kl_coef * kl[b, t] * mask[b, t]``, then the sample reward is added at
    the sample's *last* masked token: ``r_tok[b, last_b] += rewards[b]``. Samples with no
    masked token get an all-zero row (their reward has nowhere to go). ``kl`` is a per-token
    KL estimate (see ``relax.algorithms.kl.kl_estimate``); ``kl=None`` means no penalty.
    Returns ``[B, T]``.
    """
    dtype = _out_dtype(rewards, *([kl] if kl is not None else []))
    bool_mask, _ = as_mask(mask, rewards)
    B, T = bool_mask.shape
    if kl is not None and kl_coef != 0.0:
        tok = zero_outside(-kl_coef * kl.to(dtype), bool_mask)
    else:
        tok = torch.zeros((B, T), dtype=dtype, device=bool_mask.device)
    if T == 0:
        return tok
    last, has = _last_token_index(bool_mask)
    add = torch.where(has, rewards.to(dtype), torch.zeros((), dtype=dtype, device=tok.device))
    return tok.scatter_add(1, last.unsqueeze(1), add.unsqueeze(1))


@torch.no_grad()
def kl_shaped_rewards(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-sample rewards with the sequence KL penalty (``--kl-coef`` for per-sample estimators), ``[B]``.

    ``r'_b = r_b - kl_coef * sum_t kl[b, t] * mask[b, t]``, to be given to ``grpo_advantages`` /
    ``rloo_advantages`` / ``group_mean_baseline`` in place of ``r`` (the penalty is part of the reward
    that is group-normalised). ``kl=None`` or ``kl_coef == 0`` returns the rewards unchanged (as float).
    """
    dtype = _out_dtype(rewards, *([kl] if kl is not None else []))
    out = rewards.to(dtype)
    if kl is None or kl_coef == 0.0:
        return out.clone()
    bool_mask, _ = as_mask(mask, kl)
    return out - kl_coef * zero_outside(kl.to(dtype), bool_mask).sum(dim=-1)


@torch.no_grad()
def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted return-to-go over masked tokens: ``G_t = r_t + gamma * G_{t'}``.

    ``t'`` is the next *masked* position after ``t`` (``G = 0`` after the last one);
    unmasked positions contribute no reward and no discount, and get ``G = 0``. With
    ``gamma == 1`` this is a reverse cumulative sum of masked rewards. Returns ``[B, T]``.
    """
    dtype = _out_dtype(token_rewards)
    bool_mask, _ = as_mask(mask, token_rewards)
    r = zero_outside(token_rewards.to(dtype), bool_mask)
    if gamma == 1.0:
        out = torch.flip(torch.cumsum(torch.flip(r, dims=[-1]), dim=-1), dims=[-1])
        return zero_outside(out, bool_mask)
    B, T = r.shape
    running = torch.zeros(B, dtype=dtype, device=r.device)
    cols = []
    for t in range(T - 1, -1, -1):
        valid = bool_mask[:, t]
        running = torch.where(valid, r[:, t] + gamma * running, running)
        cols.append(torch.where(valid, running, torch.zeros_like(running)))
    if not cols:
        return r.clone()
    return torch.stack(cols[::-1], dim=1)


@torch.no_grad()
def reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    whiten_advantages: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ advantages (Hu, arXiv:2501.03262), ``[B, T]``.

    1. token rewards: if ``rewards`` is ``[B]``, ``r_tok = kl_penalized_token_rewards(rewards,
       mask, kl=kl, kl_coef=kl_coef)`` (``-kl_coef*kl`` per token, sample reward on the last
       token); if ``rewards`` is already ``[B, T]`` token rewards, ``r_tok = rewards -
       kl_coef*kl`` (KL term only when ``kl`` is given);
    2. ``G = discounted_returns(r_tok, mask, gamma)``;
    3. ``A = whiten(G, mask)`` over the whole batch (the paper's global advantage
       normalization; skipped with ``whiten_advantages=False``).
    """
    bool_mask, _ = as_mask(mask, rewards)
    if rewards.dim() == 1:
        tok = kl_penalized_token_rewards(rewards, bool_mask, kl=kl, kl_coef=kl_coef)
    else:
        dtype = _out_dtype(rewards, *([kl] if kl is not None else []))
        tok = rewards.to(dtype)
        if kl is not None and kl_coef != 0.0:
            tok = tok - kl_coef * kl.to(dtype)
        tok = zero_outside(tok, bool_mask)
    returns = discounted_returns(tok, bool_mask, gamma)
    return whiten(returns, bool_mask, eps=eps) if whiten_advantages else returns


@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    whiten_advantages: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++-baseline advantages (arXiv:2501.03262 v2+), ``[B, T]``.

    With the KL-shaped reward ``r'_b = r_b - kl_coef * sum_t kl[b, t] * mask[b, t]``
    (``kl_shaped_rewards``; ``r' = r`` without ``kl``): ``A0[b, t] = r'_b - mean_{g(b)} r'`` on
    masked tokens (group-mean baseline, no std division), then ``A = whiten(A0, mask)`` over the
    whole batch. Singleton groups get a centered reward of 0 (before whitening).
    """
    bool_mask, _ = as_mask(mask, rewards)
    shaped = kl_shaped_rewards(rewards, bool_mask, kl=kl, kl_coef=kl_coef)
    centered = group_mean_baseline(shaped, group_ids)
    dtype = _out_dtype(centered)
    a0 = zero_outside(centered.to(dtype).unsqueeze(-1).expand(bool_mask.shape), bool_mask)
    return whiten(a0, bool_mask, eps=eps) if whiten_advantages else a0


@torch.no_grad()
def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015) for PPO.

    Over the masked positions ``t_1 < ... < t_n`` of a row (token rewards ``r`` — e.g.
    from ``kl_penalized_token_rewards`` — and critic values ``V``, both ``[B, T]``)::

        delta_k = r_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}      (V_{t_{n+1}} = 0)
        A_{t_k} = delta_k + gamma * lam * A_{t_{k+1}}          (A_{t_{n+1}} = 0)
        R_{t_k} = A_{t_k} + V_{t_k}

    Returns ``(advantages, returns)``, both ``[B, T]`` and 0 outside the mask. No whitening
    is applied here (use ``whiten``).
    """
    dtype = _out_dtype(rewards, values)
    bool_mask, _ = as_mask(mask, rewards)
    r = zero_outside(rewards.to(dtype), bool_mask)
    v = zero_outside(values.to(dtype), bool_mask)
    B, T = r.shape
    gae = torch.zeros(B, dtype=dtype, device=r.device)
    next_v = torch.zeros(B, dtype=dtype, device=r.device)
    cols = []
    coef = gamma * lam
    for t in range(T - 1, -1, -1):
        valid = bool_mask[:, t]
        vt = v[:, t]
        new_gae = r[:, t] + gamma * next_v - vt + coef * gae
        gae = torch.where(valid, new_gae, gae)
        next_v = torch.where(valid, vt, next_v)
        cols.append(torch.where(valid, gae, torch.zeros_like(gae)))
    adv = torch.stack(cols[::-1], dim=1) if cols else r.clone()
    returns = zero_outside(adv + v, bool_mask)
    return adv, returns


@torch.no_grad()
def opd_advantages(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 1.0,
) -> torch.Tensor:
    """On-policy distillation advantage term, ``[B, T]``.

    ``A_opd[b, t] = coef * (teacher_logprobs[b, t] - student_logprobs[b, t]) * mask[b, t]``,
    i.e. ``coef`` times the negative per-token reverse-KL sample ``log pi_T - log pi_S`` on
    the student's own tokens. Add it to any estimator's (token-broadcast) advantages:
    ``adv = broadcast_to_tokens(grpo_advantages(...), mask) + opd_advantages(...)``.
    """
    dtype = _out_dtype(student_logprobs, teacher_logprobs)
    bool_mask, _ = as_mask(mask, student_logprobs)
    diff = teacher_logprobs.to(dtype) - student_logprobs.to(dtype)
    return zero_outside(coef * diff, bool_mask)
