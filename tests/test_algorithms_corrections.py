"""Tests for relax.algorithms.corrections (TIS, OPSM, mismatch metrics)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.algorithms.corrections import mismatch_metrics, opsm_mask, sequence_log_ratio, tis_weights
from relax.algorithms.losses import ppo_policy_loss, token_mean

D = torch.float64


def batch(seed, B=5, T=7, spread=0.6):
    rng = np.random.default_rng(seed)
    rollout = -rng.random((B, T)) * 3
    train = rollout + rng.normal(scale=spread, size=(B, T))
    m = rng.random((B, T)) < 0.7
    m[0] = True
    m[-1] = False
    return train, rollout, m


def np_mean(x, m):
    return x[m].mean() if m.sum() else 0.0


# ------------------------------------------------------------------ TIS


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_tis_weights_match_numpy(mode):
    train, rollout, m = batch(0)
    tr = torch.tensor(train, requires_grad=True)
    w, met = tis_weights(tr, torch.tensor(rollout), torch.tensor(m), clip=1.5, clip_low=0.7, mode=mode)
    rho = np.exp(train - rollout)
    outside = (rho < 0.7) | (rho > 1.5)
    exp_w = np.clip(rho, 0.7, 1.5) if mode == "truncate" else np.where(outside, 0.0, rho)
    np.testing.assert_allclose(w.numpy(), np.where(m, exp_w, 0.0), rtol=1e-12)
    assert not w.requires_grad
    assert met["tis_clip_fraction"].item() == pytest.approx(np_mean(outside.astype(float), m))
    assert met["tis_weight_mean"].item() == pytest.approx(np_mean(exp_w, m))
    assert met["tis_ratio_mean"].item() == pytest.approx(np_mean(rho, m))
    assert 0 < met["tis_clip_fraction"].item() < 1


def test_tis_defaults_and_use_in_loss():
    train, rollout, m = batch(1)
    w, _ = tis_weights(torch.tensor(train), torch.tensor(rollout), torch.tensor(m))
    rho = np.exp(train - rollout)
    np.testing.assert_allclose(w.numpy(), np.where(m, np.clip(rho, 0.0, 2.0), 0.0), rtol=1e-12)
    # weight multiplies the per-token policy loss; gradient scales accordingly
    lp = torch.tensor(train, requires_grad=True)
    adv = torch.ones(5, dtype=D)
    loss, _ = ppo_policy_loss(lp, lp.detach(), adv, torch.tensor(m), eps_clip=0.2)
    (loss * w).sum().backward()
    np.testing.assert_allclose(lp.grad.numpy(), -w.numpy(), rtol=1e-12)


def test_tis_argument_checks_and_empty():
    with pytest.raises(ValueError):
        tis_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), mode="clip")
    with pytest.raises(ValueError):
        tis_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), clip=1.0, clip_low=2.0)
    w, met = tis_weights(torch.zeros(2, 3), torch.full((2, 3), float("nan")), torch.zeros(2, 3))
    assert torch.equal(w, torch.zeros(2, 3))
    assert all(v.item() == 0.0 for v in met.values())


# ------------------------------------------------------------------ OPSM


def np_opsm(logprobs, rollout, adv, m, delta):
    B, T = logprobs.shape
    A = adv[:, None] * np.ones((B, T)) if adv.ndim == 1 else adv
    keep = np.zeros((B, T))
    for b in range(B):
        toks = [t for t in range(T) if m[b, t]]
        d = np.mean([rollout[b, t] - logprobs[b, t] for t in toks]) if toks else 0.0
        for t in toks:
            keep[b, t] = 0.0 if (A[b, t] < 0 and d > delta) else 1.0
    return keep


@pytest.mark.parametrize("per_sample", [True, False])
def test_opsm_matches_definition(per_sample):
    rng = np.random.default_rng(2)
    B, T = 8, 6
    rollout = -rng.random((B, T)) * 3
    # half the samples drift far from the rollout policy (current policy less likely)
    drift = np.where(np.arange(B)[:, None] % 2 == 0, -0.5, 0.01)
    logprobs = rollout + drift + rng.normal(scale=0.01, size=(B, T))
    adv = rng.normal(size=B) if per_sample else rng.normal(size=(B, T))
    m = rng.random((B, T)) < 0.8
    m[3] = False
    lp = torch.tensor(logprobs, requires_grad=True)
    keep, met = opsm_mask(lp, torch.tensor(rollout), torch.tensor(adv), torch.tensor(m), delta=0.1)
    expected = np_opsm(logprobs, rollout, adv, m, 0.1)
    np.testing.assert_array_equal(keep.numpy(), expected)
    assert not keep.requires_grad
    dropped = m & (expected == 0)
    assert dropped.any() and (m & (expected == 1)).any()
    assert met["opsm_token_fraction"].item() == pytest.approx(dropped.sum() / m.sum())
    rows = m.any(1)
    assert met["opsm_seq_fraction"].item() == pytest.approx(dropped.any(1)[rows].mean())
    seq = np.array([(rollout[b] - logprobs[b])[m[b]].mean() for b in range(B) if rows[b]])
    assert met["opsm_seq_kl_mean"].item() == pytest.approx(seq.mean())


def test_opsm_never_masks_positive_advantages_or_on_policy():
    rollout = torch.log(torch.full((2, 4), 0.5, dtype=D))
    far = rollout - 2.0
    keep, _ = opsm_mask(far, rollout, torch.tensor([1.0, 0.0], dtype=D), torch.ones(2, 4), delta=0.1)
    assert torch.equal(keep, torch.ones(2, 4, dtype=D))
    keep, _ = opsm_mask(rollout, rollout, torch.tensor([-1.0, -1.0], dtype=D), torch.ones(2, 4), delta=0.0)
    assert torch.equal(keep, torch.ones(2, 4, dtype=D))  # D = 0, not > 0
    keep, met = opsm_mask(far, rollout, torch.tensor([-1.0, -1.0], dtype=D), torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]), delta=0.1)
    assert keep.tolist() == [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert met["opsm_seq_fraction"].item() == 1.0


def test_sequence_log_ratio():
    lp = torch.tensor([[-1.0, -2.0, 9.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [1.0, 1.0, 1.0]])
    out = sequence_log_ratio(lp, ref, torch.tensor([[1, 1, 0], [0, 0, 0]]))
    assert out.tolist() == [pytest.approx(-0.25), 0.0]


# ------------------------------------------------------------------ mismatch metrics


def test_mismatch_metrics_match_numpy():
    train, rollout, m = batch(3)
    met = mismatch_metrics(torch.tensor(train), torch.tensor(rollout), torch.tensor(m))
    d = (train - rollout)[m]
    rho = np.exp(d)
    seq = [np.mean((train[b] - rollout[b])[m[b]]) for b in range(len(m)) if m[b].any()]
    expected = {
        "logprob_abs_diff_mean": np.abs(d).mean(),
        "k1_kl": (-d).mean(),
        "k3_kl": (rho - 1 - d).mean(),
        "ratio_mean": rho.mean(),
        "ratio_std": rho.std(),
        "ratio_min": rho.min(),
        "ratio_max": rho.max(),
        "seq_abs_log_ratio_mean": np.mean(np.abs(seq)),
    }
    assert set(met) == set(expected)
    for k, v in expected.items():
        assert met[k].item() == pytest.approx(v, rel=1e-9), k


def test_mismatch_metrics_empty_and_identical():
    met = mismatch_metrics(torch.zeros(2, 3), torch.full((2, 3), float("nan")), torch.zeros(2, 3))
    for k, v in met.items():
        assert v.item() == (1.0 if k in ("ratio_mean", "ratio_min", "ratio_max") else 0.0), k
    x = torch.randn(3, 4)
    met = mismatch_metrics(x, x, torch.ones(3, 4))
    assert met["k3_kl"].item() == 0.0 and met["ratio_std"].item() == 0.0 and met["ratio_max"].item() == 1.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-10, 0), st.floats(-10, 0), st.booleans()), min_size=1, max_size=20))
def test_property_mismatch_k3_nonnegative_and_ratio_bounds(rows):
    train = torch.tensor([[r[0] for r in rows]], dtype=D)
    rollout = torch.tensor([[r[1] for r in rows]], dtype=D)
    m = torch.tensor([[r[2] for r in rows]])
    met = mismatch_metrics(train, rollout, m)
    assert met["k3_kl"].item() >= 0
    assert met["ratio_min"].item() <= met["ratio_mean"].item() * (1 + 1e-9) + 1e-12
    assert met["ratio_mean"].item() <= met["ratio_max"].item() * (1 + 1e-9) + 1e-12
    assert all(np.isfinite(v.item()) for v in met.values())
    w, _ = tis_weights(train, rollout, m, clip=2.0, clip_low=0.5)
    assert ((w == 0) | ((w >= 0.5) & (w <= 2.0))).all()
    assert token_mean(w, m).item() <= 2.0
