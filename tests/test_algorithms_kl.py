"""Tests for relax.algorithms.kl.kl_estimate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.algorithms.kl import KL_KINDS, kl_estimate


def np_kl(lp, ref, kind):
    x = lp - ref
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        return np.exp(-x) - 1 + x
    xc = np.clip(x, -20, 20)
    return np.clip(np.exp(-xc) - 1 + xc, -10, 10)


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kinds_match_numpy_with_mask(kind):
    rng = np.random.default_rng(0)
    lp = -rng.random((3, 6)) * 3
    ref = -rng.random((3, 6)) * 3
    m = rng.random((3, 6)) < 0.6
    lpt = torch.tensor(lp, dtype=torch.float32)
    lpt[~torch.tensor(m)] = float("-inf")  # padding garbage must not leak
    out = kl_estimate(lpt, torch.tensor(ref, dtype=torch.float32), kind, mask=torch.tensor(m))
    np.testing.assert_allclose(out.numpy(), np.where(m, np_kl(lp, ref, kind), 0.0), rtol=1e-5, atol=1e-6)
    no_mask = kl_estimate(torch.tensor(lp), torch.tensor(ref), kind)
    assert no_mask.dtype == torch.float64
    np.testing.assert_allclose(no_mask.numpy(), np_kl(lp, ref, kind), rtol=1e-10)


def test_low_var_kl_is_clamped():
    lp = torch.tensor([0.0, 0.0, -30.0])
    ref = torch.tensor([-50.0, 30.0, 0.0])
    out = kl_estimate(lp, ref, "low_var_kl")
    assert torch.isfinite(out).all()
    assert out.max().item() == 10.0
    k3 = kl_estimate(lp, ref, "k3")
    assert k3[1].item() > 1e6  # unclamped k3 explodes for the same input


def test_unknown_kind_and_missing_old():
    with pytest.raises(ValueError):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k3", unbiased=True)


@pytest.mark.parametrize("kind", KL_KINDS)
def test_unbiased_is_importance_weighted(kind):
    rng = np.random.default_rng(1)
    lp, ref, old = (-rng.random((2, 5)) * 2 for _ in range(3))
    m = np.ones((2, 5), dtype=bool)
    m[1, 3:] = False
    out = kl_estimate(
        torch.tensor(lp), torch.tensor(ref), kind, mask=torch.tensor(m), unbiased=True, old_logprobs=torch.tensor(old)
    )
    x = lp - ref
    base = {"k1": x, "k2": 0.5 * x * x}.get(kind, np.exp(-x) - 1 + x)
    expected = np.exp(lp - old) * base
    if kind == "low_var_kl":
        expected = np.clip(expected, -10, 10)
    np.testing.assert_allclose(out.numpy(), np.where(m, expected, 0.0), rtol=1e-10)


def test_unbiased_low_var_kl_has_no_log_ratio_clamp():
    # slime's use_unbiased_kl low_var_kl: clamp(rho * (exp(-x) - 1 + x), -10, 10), x never clamped. With |x| > 20
    # and a small rho the product is inside [-10, 10] and differs from the x-clamped one
    lp = torch.tensor([-30.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-5.0, -27.0], dtype=torch.float64)  # x = -25, +25
    old = torch.tensor([-5.0, -2.0 + np.log(5.0)], dtype=torch.float64)  # rho = e^-25, 0.2
    out = kl_estimate(lp, ref, "low_var_kl", unbiased=True, old_logprobs=old)
    x, rho = (lp - ref).numpy(), np.exp((lp - old).numpy())
    expected = np.clip(rho * (np.exp(-x) - 1 + x), -10, 10)
    assert np.all(np.abs(expected) < 10)  # the final clamp is not what decides these values
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-12)
    xc = np.clip(x, -20, 20)
    assert np.all(np.abs(rho * (np.exp(-xc) - 1 + xc) - expected) > 0.1)  # an x clamp would change them
    # without the ratio it is verl's low_var_kl, whose x clamp changes no value
    plain = kl_estimate(lp, ref, "low_var_kl")
    np.testing.assert_allclose(plain.numpy(), np.clip(np.exp(-x) - 1 + x, -10, 10), rtol=1e-12)


def test_unbiased_low_var_kl_overflow_gives_the_clamp_with_finite_gradient():
    lp = torch.tensor([-100.0, -1.0], requires_grad=True)  # exp(-x) overflows float32 at x = -100
    ref = torch.tensor([0.0, -1.5])
    old = torch.tensor([-100.0, -1.2])
    out = kl_estimate(lp, ref, "low_var_kl", unbiased=True, old_logprobs=old)
    assert out[0].item() == 10.0 and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0].item() == 0.0


def test_k3_and_unbiased_k3_expectations_are_exact_kl_and_gradient():
    """Over a categorical vocab: E_p[k3] = KL(p||q); E_old[rho*k3] = KL(p||q) and its gradient
    w.r.t. the policy logits equals grad KL(p||q) (gradient flows through rho)."""
    torch.manual_seed(0)
    V = 7
    theta = torch.randn(V, dtype=torch.float64, requires_grad=True)
    old_logits = torch.randn(V, dtype=torch.float64)
    ref_logits = torch.randn(V, dtype=torch.float64)
    logp = torch.log_softmax(theta, -1)
    logq = torch.log_softmax(ref_logits, -1)
    logp_old = torch.log_softmax(old_logits, -1)
    true_kl = (logp.exp() * (logp - logq)).sum()
    (g_true,) = torch.autograd.grad(true_kl, theta, retain_graph=True)

    on_policy = (logp.exp().detach() * kl_estimate(logp, logq, "k3")).sum()
    assert abs(on_policy.item() - true_kl.item()) < 1e-12

    est = (logp_old.exp() * kl_estimate(logp, logq, "k3", unbiased=True, old_logprobs=logp_old)).sum()
    assert abs(est.item() - true_kl.item()) < 1e-12
    (g_est,) = torch.autograd.grad(est, theta, retain_graph=True)
    torch.testing.assert_close(g_est, g_true, rtol=1e-10, atol=1e-12)

    # the plain (biased) k3 gradient differs from the true KL gradient
    biased = (logp_old.exp() * kl_estimate(logp, logq, "k3")).sum()
    (g_biased,) = torch.autograd.grad(biased, theta)
    assert (g_biased - g_true).abs().max().item() > 1e-3


def test_mask_blocks_nan_gradients():
    lp = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    ref = torch.tensor([[-2.0, float("nan")]])
    out = kl_estimate(lp, ref, "k3", mask=torch.tensor([[1, 0]]))
    out.sum().backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1].item() == 0.0


def test_bf16_inputs_computed_in_float32():
    out = kl_estimate(torch.tensor([-1.0], dtype=torch.bfloat16), torch.tensor([-1.5], dtype=torch.bfloat16), "k2")
    assert out.dtype == torch.float32


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-15, 0), st.floats(-15, 0)), min_size=1, max_size=20))
def test_property_k2_k3_nonnegative(pairs):
    lp = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    ref = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    for kind in ("k2", "k3", "low_var_kl"):
        assert (kl_estimate(lp, ref, kind) >= 0).all()
