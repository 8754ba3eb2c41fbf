"""Tests for relax.algorithms.advantages against independent numpy / hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.algorithms.advantages import (
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

HYP = settings(max_examples=40, deadline=None)


# ------------------------------------------------------------------ numpy references


def np_grpo(rewards, groups, normalize_std=True, eps=1e-6):
    rewards = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(rewards)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        vals = rewards[idx]
        mean = vals.mean()
        std = vals.std(ddof=1) if len(idx) > 1 else 0.0
        for i in idx:
            out[i] = (rewards[i] - mean) / (std + eps) if normalize_std else rewards[i] - mean
    return out


def np_rloo(rewards, groups):
    out = np.zeros(len(rewards))
    for i, g in enumerate(groups):
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == g and j != i]
        out[i] = rewards[i] - np.mean(others) if others else 0.0
    return out


def np_whiten(x, m, shift_mean=True, eps=1e-8):
    x = np.asarray(x, dtype=np.float64)
    m = np.asarray(m, dtype=bool)
    out = np.zeros_like(x)
    if m.sum() == 0:
        return out
    vals = x[m]
    mu = vals.mean()
    var = ((vals - mu) ** 2).sum() / max(len(vals) - 1, 1)  # unbiased, as verl's masked_whiten
    w = (vals - mu) / math.sqrt(var + eps)
    out[m] = w + (0 if shift_mean else mu)
    return out


def np_token_rewards(rewards, m, kl=None, kl_coef=0.0):
    m = np.asarray(m, dtype=bool)
    B, T = m.shape
    out = np.zeros((B, T))
    for b in range(B):
        pos = [t for t in range(T) if m[b, t]]
        for t in pos:
            if kl is not None:
                out[b, t] = -kl_coef * kl[b, t]
        if pos:
            out[b, pos[-1]] += rewards[b]
    return out


def np_returns(r, m, gamma):
    m = np.asarray(m, dtype=bool)
    B, T = m.shape
    out = np.zeros((B, T))
    for b in range(B):
        pos = [t for t in range(T) if m[b, t]]
        g = 0.0
        for t in reversed(pos):
            g = r[b, t] + gamma * g
            out[b, t] = g
    return out


def np_gae(r, v, m, gamma, lam):
    m = np.asarray(m, dtype=bool)
    B, T = m.shape
    adv = np.zeros((B, T))
    ret = np.zeros((B, T))
    for b in range(B):
        pos = [t for t in range(T) if m[b, t]]
        # explicit definition: A_k = sum_{l>=k} (gamma*lam)^(l-k) delta_l
        deltas = []
        for k, t in enumerate(pos):
            nv = v[b, pos[k + 1]] if k + 1 < len(pos) else 0.0
            deltas.append(r[b, t] + gamma * nv - v[b, t])
        for k, t in enumerate(pos):
            adv[b, t] = sum((gamma * lam) ** (l - k) * deltas[l] for l in range(k, len(pos)))
            ret[b, t] = adv[b, t] + v[b, t]
    return adv, ret


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def assert_close(a, b, atol=1e-5, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), atol=atol, rtol=rtol)


def random_mask(rng, B, T, p=0.7):
    return rng.random((B, T)) < p


# ------------------------------------------------------------------ GRPO / RLOO


def test_grpo_hand_values():
    r = t([1.0, 0.0, 1.0, 0.5, 2.0])
    g = torch.tensor([3, 3, 3, 7, 9])
    a = grpo_advantages(r, g)
    # group 3: mean 2/3, sample std = sqrt(1/3)
    s = math.sqrt(1 / 3)
    assert_close(a, [(1 / 3) / (s + 1e-6), (-2 / 3) / (s + 1e-6), (1 / 3) / (s + 1e-6), 0.0, 0.0])
    assert a.dtype == torch.float32


def test_grpo_matches_numpy_noncontiguous_groups():
    rng = np.random.default_rng(0)
    r = rng.normal(size=13)
    groups = [5, 100, 5, -2, 100, 5, 7, -2, 100, 3, 3, 3, 3]
    for norm in (True, False):
        a = grpo_advantages(t(r), torch.tensor(groups), normalize_std=norm)
        assert_close(a, np_grpo(r, groups, norm), atol=1e-5)


def test_grpo_dr_grpo_is_centered_reward():
    r = t([3.0, 1.0, 2.0, 10.0])
    g = torch.tensor([0, 0, 0, 1])
    assert_close(grpo_advantages(r, g, normalize_std=False), [1.0, -1.0, 0.0, 0.0])
    assert_close(group_mean_baseline(r, g), [1.0, -1.0, 0.0, 0.0])


def test_grpo_edge_cases():
    empty = grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0,)
    single = grpo_advantages(t([4.2]), torch.tensor([0]))
    assert single.tolist() == [0.0]
    # all-equal rewards (values not exactly representable) -> exactly 0, no NaN
    same = grpo_advantages(t([0.1, 0.1, 0.1, 0.7, 0.7]), torch.tensor([1, 1, 1, 2, 2]))
    assert torch.equal(same, torch.zeros(5))
    assert torch.isfinite(rloo_advantages(t([0.1, 0.1, 0.1]), torch.tensor([0, 0, 0]))).all()
    # int rewards accepted
    ints = grpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]), normalize_std=False)
    assert_close(ints, [0.5, -0.5])


def test_grpo_keeps_float64_and_has_no_grad():
    r = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64, requires_grad=True)
    a = grpo_advantages(r, torch.tensor([0, 0, 0]))
    assert a.dtype == torch.float64
    assert not a.requires_grad


def test_rloo_matches_numpy():
    rng = np.random.default_rng(1)
    r = rng.normal(size=11)
    groups = [0, 0, 1, 1, 1, 2, 3, 3, 3, 3, 0]
    assert_close(rloo_advantages(t(r, torch.float64), torch.tensor(groups)), np_rloo(r, groups), atol=1e-10)


group_case = st.integers(min_value=1, max_value=12).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=n, max_size=n),
        st.lists(st.integers(0, 4), min_size=n, max_size=n),
    )
)


@HYP
@given(group_case)
def test_property_group_advantages_have_zero_group_mean(case):
    rewards, groups = case
    r = t(rewards, torch.float64)
    g = torch.tensor(groups)
    for adv in (grpo_advantages(r, g), grpo_advantages(r, g, normalize_std=False), rloo_advantages(r, g)):
        assert torch.isfinite(adv).all()
        for gid in set(groups):
            sel = g == gid
            assert abs(adv[sel].mean().item()) < 1e-6
    # normalized advantages: group sample std is std/(std+eps) <= 1
    a = grpo_advantages(r, g)
    for gid in set(groups):
        sel = g == gid
        if sel.sum() > 1:
            assert a[sel].std().item() <= 1.0 + 1e-9
    assert_close(grpo_advantages(r, g), np_grpo(rewards, groups), atol=1e-6)


# ------------------------------------------------------------------ token helpers


def test_broadcast_to_tokens():
    m = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    out = broadcast_to_tokens(t([2.0, -1.0, 5.0]), m)
    assert out.tolist() == [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0], [0.0, 0.0, 0.0]]


def test_whiten_matches_numpy_and_ignores_padding_garbage():
    rng = np.random.default_rng(2)
    x = rng.normal(3.0, 2.0, size=(4, 7))
    m = random_mask(rng, 4, 7)
    xt = t(x)
    xt[~torch.tensor(m)] = float("nan")
    for shift in (True, False):
        out = whiten(xt, torch.tensor(m), shift_mean=shift)
        assert_close(out, np_whiten(x, m, shift), atol=1e-5)
    out = whiten(xt, torch.tensor(m))
    vals = out[torch.tensor(m)].double()
    assert abs(vals.mean().item()) < 1e-6
    assert abs(vals.var(unbiased=True).item() - 1.0) < 1e-4  # the unbiased (n-1) variance is 1


def test_whiten_edge_cases():
    assert torch.equal(whiten(torch.ones(2, 3), torch.zeros(2, 3)), torch.zeros(2, 3))
    one = whiten(t([[5.0, 1.0]]), torch.tensor([[1, 0]]))
    assert one.tolist() == [[0.0, 0.0]]
    # unbiased variance: (1 + 1) / (2 - 1) = 2, so +-1/sqrt(2) (the population variance would give +-1)
    assert_close(whiten(t([1.0, 3.0])), [-(0.5 ** 0.5), 0.5 ** 0.5], atol=1e-6)
    x = torch.tensor([0.3, -1.2, 2.5, 0.7, 4.0], dtype=torch.float64)
    assert_close(whiten(x, eps=0.0), (x - x.mean()) / x.std(unbiased=True), atol=1e-12, rtol=1e-12)


def test_kl_penalized_token_rewards():
    rng = np.random.default_rng(3)
    m = np.array([[1, 1, 1, 0, 0], [0, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=bool)
    kl = rng.normal(size=m.shape)
    rewards = np.array([1.0, -2.0, 3.0, 0.5])
    out = kl_penalized_token_rewards(t(rewards), torch.tensor(m), kl=t(kl), kl_coef=0.1)
    assert_close(out, np_token_rewards(rewards, m, kl, 0.1))
    out0 = kl_penalized_token_rewards(t(rewards), torch.tensor(m))
    assert out0.tolist()[0] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert out0.tolist()[1] == [0.0, 0.0, 0.0, -2.0, 0.0]
    assert out0.tolist()[2] == [0.0] * 5  # no token: reward dropped, no error


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_discounted_returns(gamma):
    rng = np.random.default_rng(4)
    r = rng.normal(size=(5, 9))
    m = random_mask(rng, 5, 9)
    m[0] = False
    out = discounted_returns(t(r), torch.tensor(m), gamma)
    assert_close(out, np_returns(r, m, gamma), atol=1e-5)


def test_reinforce_plus_plus():
    rng = np.random.default_rng(5)
    m = random_mask(rng, 6, 8)
    m[2] = False
    kl = rng.normal(size=m.shape)
    rewards = rng.normal(size=6)
    gamma = 0.95
    tok = np_token_rewards(rewards, m, kl, 0.05)
    ret = np_returns(tok, m, gamma)
    out = reinforce_plus_plus_advantages(t(rewards), torch.tensor(m), kl=t(kl), kl_coef=0.05, gamma=gamma)
    assert_close(out, np_whiten(ret, m), atol=1e-4)
    raw = reinforce_plus_plus_advantages(
        t(rewards), torch.tensor(m), kl=t(kl), kl_coef=0.05, gamma=gamma, whiten_advantages=False
    )
    assert_close(raw, ret, atol=1e-5)
    # token-reward input form
    tok_in = reinforce_plus_plus_advantages(t(tok), torch.tensor(m), gamma=gamma, whiten_advantages=False)
    assert_close(tok_in, ret, atol=1e-5)
    tok_kl = reinforce_plus_plus_advantages(
        t(np_token_rewards(rewards, m)), torch.tensor(m), kl=t(kl), kl_coef=0.05, gamma=gamma, whiten_advantages=False
    )
    assert_close(tok_kl, ret, atol=1e-5)


def test_reinforce_plus_plus_baseline():
    rng = np.random.default_rng(6)
    m = random_mask(rng, 6, 5)
    m[5] = False
    kl = rng.normal(size=m.shape)
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.3, 2.0])
    groups = [0, 0, 0, 1, 1, 2]
    centered = np_grpo(rewards, groups, normalize_std=False)
    # --kl-coef shapes the reward before the group centring: r - kl_coef * sum_t KL_t per sample
    shaped = rewards - 0.1 * np.where(m, kl, 0.0).sum(axis=1)
    a0 = np.where(m, np_grpo(shaped, groups, normalize_std=False)[:, None], 0.0)
    out = reinforce_plus_plus_baseline_advantages(t(rewards), torch.tensor(groups), torch.tensor(m), kl=t(kl), kl_coef=0.1)
    assert_close(out, np_whiten(a0, m), atol=1e-4)
    unwhitened = reinforce_plus_plus_baseline_advantages(t(rewards), torch.tensor(groups), torch.tensor(m), kl=t(kl),
                                                         kl_coef=0.1, whiten_advantages=False)
    assert_close(unwhitened, a0, atol=1e-6)
    # every token of a sample has the same advantage (no per-token KL term after the centring)
    for b in range(5):
        vals = unwhitened[b][torch.tensor(m[b])]
        assert vals.numel() == 0 or torch.allclose(vals, vals[0].expand_as(vals))
    raw = reinforce_plus_plus_baseline_advantages(
        t(rewards), torch.tensor(groups), torch.tensor(m), whiten_advantages=False
    )
    assert_close(raw, np.where(m, centered[:, None], 0.0), atol=1e-6)


def test_kl_shaped_rewards():
    from relax.algorithms.advantages import kl_shaped_rewards

    rng = np.random.default_rng(16)
    m = random_mask(rng, 5, 6)
    kl = rng.normal(size=m.shape)
    rewards = rng.normal(size=5)
    klt = t(kl, torch.float64)
    klt[~torch.tensor(m)] = float("nan")  # padding garbage does not leak
    out = kl_shaped_rewards(t(rewards, torch.float64), torch.tensor(m), kl=klt, kl_coef=0.3)
    assert_close(out, rewards - 0.3 * np.where(m, kl, 0.0).sum(axis=1), atol=1e-12, rtol=1e-12)
    assert_close(kl_shaped_rewards(t(rewards, torch.float64), torch.tensor(m)), rewards, atol=0, rtol=0)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_definition(gamma, lam):
    rng = np.random.default_rng(7)
    r = rng.normal(size=(4, 10))
    v = rng.normal(size=(4, 10))
    m = random_mask(rng, 4, 10)
    m[1] = False
    m[3] = [True] * 6 + [False] * 4  # right padding
    adv, ret = gae_advantages(t(r), t(v), torch.tensor(m), gamma, lam)
    ea, er = np_gae(r, v, m, gamma, lam)
    assert_close(adv, ea, atol=1e-4)
    assert_close(ret, er, atol=1e-4)


def test_gae_lambda_one_gives_monte_carlo_returns():
    rng = np.random.default_rng(8)
    r = rng.normal(size=(3, 6))
    v = rng.normal(size=(3, 6))
    m = np.ones((3, 6), dtype=bool)
    m[0, 4:] = False
    _, ret = gae_advantages(t(r), t(v), torch.tensor(m), 0.9, 1.0)
    assert_close(ret, np_returns(r, m, 0.9), atol=1e-5)


def test_gae_zero_length():
    adv, ret = gae_advantages(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0))
    assert adv.shape == (2, 0) and ret.shape == (2, 0)


def test_opd_advantages_added_to_estimator():
    student = t([[-1.0, -2.0, -0.5], [-0.1, -3.0, float("-inf")]])
    teacher = t([[-0.5, -2.5, -0.5], [-0.2, -1.0, -1.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    opd = opd_advantages(student, teacher, m, coef=2.0)
    assert_close(opd, [[1.0, -1.0, 0.0], [-0.2, 4.0, 0.0]])
    total = broadcast_to_tokens(grpo_advantages(t([1.0, 0.0]), torch.tensor([0, 0]), normalize_std=False), m) + opd
    assert_close(total, [[1.5, -0.5, 0.5], [-0.7, 3.5, 0.0]])
