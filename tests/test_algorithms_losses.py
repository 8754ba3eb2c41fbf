"""Tests for relax.algorithms.losses against numpy references and autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.algorithms.losses import (
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

D = torch.float64


def make_batch(seed=0, B=4, T=6, adv_per_sample=True, spread=0.5):
    rng = np.random.default_rng(seed)
    old = -rng.random((B, T)) * 3
    lp = old + rng.normal(scale=spread, size=(B, T))
    adv = rng.normal(size=B) if adv_per_sample else rng.normal(size=(B, T))
    m = rng.random((B, T)) < 0.75
    m[0, :] = True
    return lp, old, adv, m


def tt(x, grad=False):
    return torch.tensor(x, dtype=D, requires_grad=grad)


def full_adv(adv, shape):
    return adv[:, None] * np.ones(shape) if adv.ndim == 1 else adv


def np_masked_mean(x, m):
    return x[m].mean() if m.sum() else 0.0


# ------------------------------------------------------------------ reducers


def test_reducers_match_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 5))
    m = rng.random((4, 5)) < 0.6
    m[2] = False
    m[0, 0] = True
    xt = torch.tensor(x)
    xt[~torch.tensor(m)] = float("nan")
    per_sample = [x[b][m[b]].mean() for b in range(4) if m[b].any()]
    assert token_mean(xt, torch.tensor(m)).item() == pytest.approx(x[m].mean())
    assert sample_mean(xt, torch.tensor(m)).item() == pytest.approx(np.mean(per_sample))
    assert sum_of_sample_mean(xt, torch.tensor(m)).item() == pytest.approx(np.sum(per_sample))
    assert token_mean(xt, torch.tensor(m), num_tokens=100).item() == pytest.approx(x[m].sum() / 100)
    assert sample_mean(xt, torch.tensor(m), num_samples=8).item() == pytest.approx(np.sum(per_sample) / 8)
    for mode in ("token_mean", "sample_mean", "sum_of_sample_mean"):
        assert torch.isfinite(reduce_loss(xt, torch.tensor(m), mode))
    with pytest.raises(ValueError):
        reduce_loss(xt, torch.tensor(m), "mean")


@pytest.mark.parametrize("fn", [token_mean, sample_mean, sum_of_sample_mean])
def test_reducers_empty_mask_zero_and_finite_grad(fn):
    x = torch.randn(3, 4, requires_grad=True)
    out = fn(x, torch.zeros(3, 4))
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(x.grad, torch.zeros(3, 4))
    empty = torch.zeros(0, 5, requires_grad=True)
    assert fn(empty, torch.zeros(0, 5)).item() == 0.0


# ------------------------------------------------------------------ PPO


def np_ppo(lp, old, adv, m, eps, eps_high, c=None):
    A = full_adv(adv, lp.shape)
    r = np.exp(lp - old)
    l1 = -A * r
    l2 = -A * np.clip(r, 1 - eps, 1 + eps_high)
    loss = np.maximum(l1, l2)
    clipped = l2 > l1
    dual = np.zeros_like(clipped)
    if c is not None:
        bound = -c * A
        dual = (A < 0) & (loss > bound)
        loss = np.where(A < 0, np.minimum(loss, bound), loss)
    loss = np.where(m, loss, 0.0)
    return loss, np_masked_mean(clipped.astype(float), m), np_masked_mean(dual.astype(float), m), np_masked_mean(old - lp, m)


@pytest.mark.parametrize("per_sample", [True, False])
@pytest.mark.parametrize("eps_high,c", [(None, None), (0.28, None), (0.28, 1.5)])
def test_ppo_matches_numpy(per_sample, eps_high, c):
    lp, old, adv, m = make_batch(1, B=8, T=12, adv_per_sample=per_sample, spread=0.8)
    loss, met = ppo_policy_loss(tt(lp), tt(old), tt(adv), torch.tensor(m), eps_clip=0.2, eps_clip_high=eps_high, eps_clip_c=c)
    e_loss, e_clip, e_dual, e_kl = np_ppo(lp, old, adv, m, 0.2, eps_high if eps_high else 0.2, c)
    np.testing.assert_allclose(loss.detach().numpy(), e_loss, rtol=1e-10, atol=1e-12)
    assert met["clip_fraction"].item() == pytest.approx(e_clip)
    assert met["dual_clip_fraction"].item() == pytest.approx(e_dual)
    assert met["approx_kl"].item() == pytest.approx(e_kl)
    assert 0 < e_clip < 1
    if c is not None:
        assert e_dual > 0
    assert not any(v.requires_grad for v in met.values())


def test_ppo_dual_clip_hand_value():
    # A = -1, ratio = e^2 ~ 7.39 >> c = 3: standard clip gives 7.39, dual clip caps at 3.
    loss, met = ppo_policy_loss(tt([[2.0]]), tt([[0.0]]), tt([-1.0]), torch.ones(1, 1), eps_clip=0.2, eps_clip_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert met["dual_clip_fraction"].item() == 1.0
    with pytest.raises(ValueError):
        ppo_policy_loss(tt([[0.0]]), tt([[0.0]]), tt([1.0]), torch.ones(1, 1), eps_clip=0.2, eps_clip_c=1.0)


def test_ppo_gradient_without_clipping_is_minus_advantage():
    lp, _, adv, m = make_batch(2, adv_per_sample=False)
    logp = tt(lp, grad=True)
    loss, met = ppo_policy_loss(logp, logp.detach(), tt(adv), torch.tensor(m), eps_clip=0.2, eps_clip_c=3.0)
    assert met["clip_fraction"].item() == 0.0
    loss.sum().backward()
    np.testing.assert_allclose(logp.grad.numpy(), np.where(m, -adv, 0.0), rtol=1e-12)


def test_ppo_gradient_off_policy_matches_analytic():
    lp, old, adv, m = make_batch(3, adv_per_sample=False, spread=0.4)
    logp = tt(lp, grad=True)
    loss, _ = ppo_policy_loss(logp, tt(old), tt(adv), torch.tensor(m), eps_clip=0.2, eps_clip_high=0.3)
    loss.sum().backward()
    r = np.exp(lp - old)
    active = ((adv > 0) & (r < 1.3)) | ((adv < 0) & (r > 0.8))  # unclipped side of the min
    expected = np.where(m & active, -adv * r, 0.0)
    np.testing.assert_allclose(logp.grad.numpy(), expected, rtol=1e-10, atol=1e-12)


def test_ppo_padding_garbage_does_not_leak():
    lp, old, adv, m = make_batch(4)
    lpt = tt(lp, grad=True)
    bad = lpt.detach().clone()
    bad[~torch.tensor(m)] = float("nan")
    old_t = tt(old)
    old_t[~torch.tensor(m)] = float("inf")
    x = torch.where(torch.tensor(m), lpt, bad)
    loss, met = ppo_policy_loss(x, old_t, tt(adv), torch.tensor(m), eps_clip=0.2)
    token_mean(loss, torch.tensor(m)).backward()
    assert torch.isfinite(loss).all() and torch.isfinite(lpt.grad).all()
    assert all(torch.isfinite(v) for v in met.values())


def test_policy_losses_empty_mask():
    z = torch.zeros(2, 3)
    for fn, kw in (
        (ppo_policy_loss, {"eps_clip": 0.2, "eps_clip_c": 3.0}),
        (gspo_policy_loss, {"eps_clip": 0.2}),
        (sapo_policy_loss, {}),
        (cispo_policy_loss, {"eps_clip_high": 0.2}),
    ):
        loss, met = fn(z, z, torch.ones(2), z, **kw)
        assert torch.equal(loss, z)
        assert all(v.item() == 0.0 or k == "seq_ratio_mean" for k, v in met.items()), (fn, met)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-3, 3), st.floats(-5, 5)),  # (log ratio, advantage)
        min_size=1,
        max_size=16,
    ),
    st.floats(0.01, 0.5),
    st.floats(0.01, 0.5),
)
def test_property_clipped_objective_never_exceeds_unclipped(pairs, eps, eps_high):
    log_ratio = torch.tensor([[p[0] for p in pairs]], dtype=D)
    adv = torch.tensor([[p[1] for p in pairs]], dtype=D)
    m = torch.ones_like(adv)
    loss, _ = ppo_policy_loss(log_ratio, torch.zeros_like(log_ratio), adv, m, eps_clip=eps, eps_clip_high=eps_high)
    surrogate = log_ratio.exp() * adv
    assert ((-loss) <= surrogate + 1e-9).all()  # objective = -loss <= r*A
    c = 3.0
    dual, _ = ppo_policy_loss(log_ratio, torch.zeros_like(log_ratio), adv, m, eps_clip=eps, eps_clip_c=c)
    neg = adv < 0
    assert (dual[neg] <= c * adv[neg].abs() + 1e-9).all()
    assert torch.equal(dual[~neg], ppo_policy_loss(log_ratio, torch.zeros_like(log_ratio), adv, m, eps_clip=eps)[0][~neg])


# ------------------------------------------------------------------ GSPO


def np_gspo(lp, old, adv, m, eps, eps_high):
    A = full_adv(adv, lp.shape)
    loss = np.zeros_like(lp)
    clipped_tokens = 0
    for b in range(lp.shape[0]):
        n = m[b].sum()
        s = np.exp((lp[b] - old[b])[m[b]].mean()) if n else 1.0
        for t in range(lp.shape[1]):
            if not m[b, t]:
                continue
            l1 = -A[b, t] * s
            l2 = -A[b, t] * np.clip(s, 1 - eps, 1 + eps_high)
            loss[b, t] = max(l1, l2)
            clipped_tokens += l2 > l1
    return loss, clipped_tokens / max(m.sum(), 1)


def test_gspo_matches_numpy():
    lp, old, adv, m = make_batch(5, spread=0.05)
    loss, met = gspo_policy_loss(tt(lp), tt(old), tt(adv), torch.tensor(m), eps_clip=0.01, eps_clip_high=0.02)
    e_loss, e_clip = np_gspo(lp, old, adv, m, 0.01, 0.02)
    np.testing.assert_allclose(loss.detach().numpy(), e_loss, rtol=1e-10, atol=1e-12)
    assert met["clip_fraction"].item() == pytest.approx(e_clip)
    assert 0 < e_clip < 1


def test_gspo_token_gradient_equals_sequence_level_gradient():
    lp, old, adv, m = make_batch(6, spread=0.05)
    mt = torch.tensor(m)
    a = tt(lp, grad=True)
    loss, _ = gspo_policy_loss(a, tt(old), tt(adv), mt, eps_clip=10.0)  # no clipping
    sum_of_sample_mean(loss, mt).backward()
    b = tt(lp, grad=True)
    seq_log = ((b - tt(old)) * mt).sum(-1) / mt.sum(-1)
    (-(tt(adv) * seq_log.exp())).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    # per token: -A * s_b
    s = np.exp(np.array([(lp[i] - old[i])[m[i]].mean() for i in range(len(adv))]))
    np.testing.assert_allclose(loss.detach().numpy(), np.where(m, -(adv * s)[:, None], 0.0), rtol=1e-10)


def test_gspo_clipped_sequence_has_no_gradient():
    lp = tt([[0.5, 0.5, 0.5]], grad=True)
    loss, met = gspo_policy_loss(lp, tt([[0.0, 0.0, 0.0]]), tt([1.0]), torch.ones(1, 3), eps_clip=0.2)
    loss.sum().backward()
    assert met["clip_fraction"].item() == 1.0
    assert torch.equal(lp.grad, torch.zeros(1, 3, dtype=D))


# ------------------------------------------------------------------ SAPO


def test_sapo_matches_numpy_and_gradient():
    lp, old, adv, m = make_batch(7, adv_per_sample=False, spread=0.7)
    a = tt(lp, grad=True)
    loss, met = sapo_policy_loss(a, tt(old), tt(adv), torch.tensor(m), tau_pos=1.0, tau_neg=2.0)
    r = np.exp(lp - old)
    tau = np.where(adv > 0, 1.0, 2.0)
    sig = 1 / (1 + np.exp(-tau * (r - 1)))
    np.testing.assert_allclose(loss.detach().numpy(), np.where(m, -(4 / tau) * sig * adv, 0.0), rtol=1e-10)
    loss.sum().backward()
    # d/dlogp [-(4/tau) sig(tau(r-1)) A] = -A * 4 sig (1 - sig) * r
    np.testing.assert_allclose(a.grad.numpy(), np.where(m, -adv * 4 * sig * (1 - sig) * r, 0.0), rtol=1e-9)
    assert met["gate_weight_mean"].item() == pytest.approx(np_masked_mean(4 * sig * (1 - sig), m))


def test_sapo_on_policy_gradient_is_minus_advantage():
    lp, _, adv, m = make_batch(8, adv_per_sample=False)
    a = tt(lp, grad=True)
    loss, met = sapo_policy_loss(a, a.detach(), tt(adv), torch.tensor(m))
    loss.sum().backward()
    np.testing.assert_allclose(a.grad.numpy(), np.where(m, -adv, 0.0), rtol=1e-12)
    assert met["gate_weight_mean"].item() == pytest.approx(1.0)


# ------------------------------------------------------------------ CISPO


@pytest.mark.parametrize("eps_low", [None, 0.2])
def test_cispo_matches_numpy_and_gradient_only_through_logprobs(eps_low):
    lp, old, adv, m = make_batch(9, adv_per_sample=False, spread=0.6)
    a = tt(lp, grad=True)
    old_t = tt(old, grad=True)
    loss, met = cispo_policy_loss(a, old_t, tt(adv), torch.tensor(m), eps_clip_high=0.28, eps_clip=eps_low)
    r = np.exp(lp - old)
    w = np.clip(r, None if eps_low is None else 1 - eps_low, 1.28)
    np.testing.assert_allclose(loss.detach().numpy(), np.where(m, -w * adv * lp, 0.0), rtol=1e-10)
    assert met["clip_fraction"].item() == pytest.approx(np_masked_mean((w != r).astype(float), m))
    loss.sum().backward()
    np.testing.assert_allclose(a.grad.numpy(), np.where(m, -w * adv, 0.0), rtol=1e-10)
    assert old_t.grad is None or torch.equal(old_t.grad, torch.zeros_like(old_t))


# ------------------------------------------------------------------ entropy / value / sft


def test_entropy_from_logits():
    rng = np.random.default_rng(10)
    logits = rng.normal(size=(2, 3, 11)) * 3
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = -(p * np.log(p)).sum(-1)
    np.testing.assert_allclose(entropy_from_logits(torch.tensor(logits)).numpy(), expected, rtol=1e-10)
    bf = entropy_from_logits(torch.tensor(logits, dtype=torch.bfloat16))
    assert bf.dtype == torch.float32
    np.testing.assert_allclose(bf.numpy(), expected, rtol=0.05, atol=0.05)
    assert entropy_from_logits(torch.zeros(4, 8)).allclose(torch.full((4,), float(np.log(8))))


def test_entropy_with_banned_tokens_has_finite_grad():
    logits = torch.tensor([[0.0, 1.0, float("-inf"), 2.0]], requires_grad=True)
    h = entropy_from_logits(logits)
    p = np.exp([0.0, 1.0, 2.0])
    p /= p.sum()
    assert h.item() == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-6)
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    # autograd check of the entropy gradient: dH/dz_i = -p_i (log p_i + H)
    z = torch.randn(5, dtype=D, requires_grad=True)
    entropy_from_logits(z).backward()
    pz = torch.softmax(z.detach(), -1)
    hz = -(pz * pz.log()).sum()
    torch.testing.assert_close(z.grad, -pz * (pz.log() + hz))


def test_entropy_bonus_loss():
    ent = torch.tensor([[1.0, 2.0, 9.0], [3.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert entropy_bonus_loss(ent, m, 0.01).item() == pytest.approx(-0.01 * 2.0)
    assert entropy_bonus_loss(ent, m, 0.01, mode="sample_mean").item() == pytest.approx(-0.01 * (1.5 + 3.0) / 2)


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss(clip):
    rng = np.random.default_rng(11)
    v, ov, ret = (rng.normal(size=(3, 5)) for _ in range(3))
    m = rng.random((3, 5)) < 0.7
    loss, met = value_loss(tt(v), tt(ov), tt(ret), torch.tensor(m), clip)
    l1 = (v - ret) ** 2
    if clip is None:
        exp, frac = 0.5 * l1, 0.0
    else:
        l2 = (np.clip(v, ov - clip, ov + clip) - ret) ** 2
        exp, frac = 0.5 * np.maximum(l1, l2), np_masked_mean((l2 > l1).astype(float), m)
    np.testing.assert_allclose(loss.numpy(), np.where(m, exp, 0.0), rtol=1e-10)
    assert met["clip_fraction"].item() == pytest.approx(frac)


def test_value_clip_fraction_counts_exactly_the_clipped_tokens():
    # float32 values, most inside the clip range: an unclipped token must never count (old_values +
    # clamp(values - old_values) can differ from values by a rounding step and made ~0.1-0.3 % count)
    gen = torch.Generator().manual_seed(5)
    ov = 0.1 * torch.randn(64, 256, generator=gen)
    v = (0.1 * torch.randn(64, 256, generator=gen)).clamp(ov - 0.19, ov + 0.19)  # |v - ov| < clip
    ret = v + 1e-3 * torch.randn(64, 256, generator=gen)
    m = torch.ones_like(v)
    spurious = ((ov + (v - ov).clamp(-0.2, 0.2) - ret) ** 2 > (v - ret) ** 2).sum().item()
    assert spurious > 0  # the rounding the old formula counted does happen on this input
    loss, met = value_loss(v, ov, ret, m, value_clip=0.2)
    assert met["clip_fraction"].item() == 0.0
    assert torch.equal(loss, 0.5 * (v - ret) ** 2)
    # tokens moved beyond the range count exactly when the clipped branch (the larger loss) is taken: every 4th
    # token moves to ov + 0.5; half of those have a return far above (the clipped value ov + 0.2 is worse: taken),
    # the other half keep a return within the range (the clipped value is better: not taken)
    far, ret2 = v.clone(), ret.clone()
    far[:, ::4] = ov[:, ::4] + 0.5
    ret2[:, ::8] = ov[:, ::8] + 1.0
    _, met = value_loss(far, ov, ret2, m, value_clip=0.2)
    assert met["clip_fraction"].item() == 1 / 8


def test_sft_loss():
    lp = torch.tensor([[-1.0, -2.0, float("-inf")], [-0.5, float("nan"), -3.0]], requires_grad=True)
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    loss = sft_loss(lp, m)
    assert loss.tolist() == [[1.0, 2.0, 0.0], [0.5, 0.0, 3.0]]
    token_mean(loss, m).backward()
    assert torch.isfinite(lp.grad).all()
    torch.testing.assert_close(lp.grad, -m.float() / 4)
