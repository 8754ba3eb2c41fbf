"""Per-token KL-divergence estimators (Schulman, http://joschu.net/blog/kl-approx.html).

All estimators target ``KL(pi_theta || pi_ref)`` from tokens sampled by the policy, using
the per-token log-ratio ``x = log pi_theta(y_t) - log pi_ref(y_t)`` (``logprobs -
ref_logprobs``):

* ``k1``: ``x``                                    (unbiased, high variance, can be < 0)
* ``k2``: ``x**2 / 2``                             (biased, low variance, >= 0)
* ``k3``: ``exp(-x) - 1 + x``  = ``pi_ref/pi - 1 - log(pi_ref/pi)``  (unbiased, >= 0)
* ``low_var_kl``: ``k3`` with the result clamped to ``[-10, 10]``, as in verl's ``low_var_kl``
  and slime's ``compute_approx_kl``. verl also clamps the log-ratio to ``[-20, 20]`` first
  (so ``exp`` cannot overflow); without ``unbiased`` that changes no value (beyond it ``k3 > 10``
  either way), so it is applied there.

``unbiased=True`` (DeepSeek-V3.2, arXiv:2512.02556, "unbiased KL estimate") multiplies the
estimate by the importance ratio ``rho_t = pi_theta(y_t) / pi_old(y_t) =
exp(logprobs - old_logprobs)``, *with gradient through rho*, for tokens sampled from
``pi_old`` (the rollout policy): ``KL_t = rho_t * k3_t``. Since ``E_old[rho * k3] =
E_theta[k3] = KL(pi_theta || pi_ref)``, both the value and its gradient are then unbiased
estimates of the true KL and its gradient even when training off-policy. (Same as slime's
``use_unbiased_kl``: ``importance_ratio = exp(log_probs - old_log_probs)`` applied to any
``kind``, clamp for ``low_var_kl`` applied after the multiplication.) With ``unbiased`` the
log-ratio is *not* clamped (slime has no such clamp, and there it would change values:
``rho * k3`` can be within ``[-10, 10]`` while ``k3`` is not). The one difference: where
``exp(-x)`` overflows the float type (``x < -log(finfo.max)``, about -88.7 in float32) the
reference gives ``clamp(rho * inf) = 10`` with a NaN gradient (NaN value if ``rho``
underflows to 0); here the value is 10 with zero gradient.
"""

from __future__ import annotations

import math

import torch

from ._utils import as_mask, float_dtype, zero_outside

__all__ = ["KL_KINDS", "kl_estimate"]

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: str = "k1",
    *,
    mask: torch.Tensor | None = None,
    unbiased: bool = False,
    old_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate of ``KL(pi_theta || pi_ref)``; same shape as ``logprobs``.

    With ``x = logprobs - ref_logprobs``:
    ``k1 = x``; ``k2 = x^2/2``; ``k3 = exp(-x) - 1 + x``;
    ``low_var_kl = clamp(exp(-x') - 1 + x', -10, 10)`` with ``x' = clamp(x, -20, 20)`` (the same
    values as with ``x' = x``).

    ``unbiased=True`` requires ``old_logprobs`` (log-probs under the rollout/behaviour
    policy) and returns ``exp(logprobs - old_logprobs) * estimate`` (gradient flows through
    the ratio; for ``low_var_kl``: ``clamp(rho * (exp(-x) - 1 + x), -10, 10)``, no clamp of
    ``x``; see the module docstring for the overflow case).

    Gradients flow into ``logprobs`` (and into ``ref_logprobs``/``old_logprobs`` only if
    they require grad; normally they are constants). With ``mask`` the output is exactly 0
    at unmasked positions, and garbage (inf/NaN) there cannot leak into values or grads.
    Computed in at least float32.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; expected one of {KL_KINDS}")
    if unbiased and old_logprobs is None:
        raise ValueError("unbiased=True needs old_logprobs")
    dtype = float_dtype(logprobs, ref_logprobs, *([old_logprobs] if old_logprobs is not None else []))
    lp = logprobs.to(dtype)
    ref = ref_logprobs.to(dtype)
    old = old_logprobs.to(dtype) if (unbiased and old_logprobs is not None) else None
    bool_mask = None
    if mask is not None:
        bool_mask, _ = as_mask(mask, lp)
        lp = zero_outside(lp, bool_mask)
        ref = zero_outside(ref, bool_mask)
        if old is not None:
            old = zero_outside(old, bool_mask)

    x = lp - ref
    if kind == "k1":
        kl = x
    elif kind == "k2":
        kl = 0.5 * x * x
    elif kind == "k3":
        kl = torch.expm1(-x) + x
    elif not unbiased:  # low_var_kl (verl): the [-20, 20] clamp changes no value, only keeps exp finite
        xc = x.clamp(-20.0, 20.0)
        kl = torch.expm1(-xc) + xc
    else:  # low_var_kl, unbiased (slime): no log-ratio clamp; only exp(-x) overflow is kept out of the graph
        overflow = -x > math.log(torch.finfo(dtype).max)
        xs = torch.where(overflow, torch.zeros_like(x), x)
        kl = torch.expm1(-xs) + xs

    if unbiased:
        kl = torch.exp(lp - old) * kl
        if kind == "low_var_kl":
            kl = torch.where(overflow, torch.full_like(kl, 10.0), kl)
    if kind == "low_var_kl":
        kl = kl.clamp(-10.0, 10.0)
    if bool_mask is not None:
        kl = zero_outside(kl, bool_mask)
    return kl
