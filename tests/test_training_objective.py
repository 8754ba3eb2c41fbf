"""The training wiring (config -> advantages, loss terms, corrections, hooks, rules), on plain tensors."""

import sys
import types

import pytest
import torch

from relax import algorithms as alg
from relax.config import parse_config
from relax.config.errors import ConfigError
from relax.data.sample import Sample
from relax.training.advantages import compute_advantages, response_mask
from relax.training.objective import PolicyObjective

# A model path keeps the embedded-default preset (used when neither model nor data is given) out of these configs.
BASE = ["--hf-checkpoint", "unused-model-dir", "--rollout-batch-size", "2", "--n-samples-per-prompt", "3",
        "--global-batch-size", "6"]


def _config(*args):
    return parse_config([*BASE, *args])


def _samples():
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(6):
        n = 2 + i % 3
        out.append(Sample(index=i, group_index=i // 3, prompt_tokens=[1, 2, 3], response_tokens=list(range(5, 5 + n)),
                          response_logprobs=(-torch.rand(n, generator=gen)).tolist(), loss_mask=[1] * n,
                          reward=float(torch.rand((), generator=gen))))
    out[1].loss_mask[-1] = 0
    return out


def _batch(seed=0, B=3, T=4):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    mask[0, 3] = 0
    mask[2, 2:] = 0
    logprobs = (-torch.rand(B, T, generator=gen) * 2).requires_grad_(True)
    batch = {"advantages": torch.randn(B, T, generator=gen), "old_logprobs": -torch.rand(B, T, generator=gen) * 2,
             "rollout_logprobs": -torch.rand(B, T, generator=gen) * 2, "ref_logprobs": -torch.rand(B, T, generator=gen) * 2}
    return logprobs, batch, mask


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("unbiased", [False, True])
def test_kl_loss_term_equals_formula(kind, unbiased):
    extra = ["--use-unbiased-kl"] if unbiased else []
    with_kl = PolicyObjective.from_config(_config("--use-kl-loss", "--kl-loss-coef", "0.3", "--kl-loss-type", kind, *extra))
    without = PolicyObjective.from_config(_config())
    logprobs, batch, mask = _batch()
    loss_kl, report = with_kl(logprobs, None, batch, mask)
    loss_plain, _ = without(logprobs, None, batch, mask)
    kl = alg.kl_estimate(logprobs, batch["ref_logprobs"], kind, mask=mask, unbiased=unbiased,
                         old_logprobs=batch["old_logprobs"])
    expected = alg.sample_mean(kl, mask)
    assert torch.allclose(loss_kl - loss_plain, 0.3 * expected, atol=1e-6)
    assert torch.allclose(report["kl"], expected.detach())
    (g_kl,) = torch.autograd.grad(loss_kl, logprobs)
    (g_plain,) = torch.autograd.grad(loss_plain, logprobs)
    (g_expected,) = torch.autograd.grad(0.3 * expected, logprobs)
    assert torch.allclose(g_kl - g_plain, g_expected, atol=1e-6)


def test_kl_loss_needs_reference_logprobs():
    objective = PolicyObjective.from_config(_config("--use-kl-loss", "--kl-loss-coef", "0.1"))
    logprobs, batch, mask = _batch()
    del batch["ref_logprobs"]
    with pytest.raises(ValueError, match="reference"):
        objective(logprobs, None, batch, mask)


def test_tis_and_opsm_weight_the_policy_loss():
    logprobs, batch, mask = _batch(1)
    plain = PolicyObjective.from_config(_config())
    per_token, _ = alg.ppo_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], mask, eps_clip=0.2,
                                       eps_clip_high=0.2)
    tis = PolicyObjective.from_config(_config("--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "0.5"))
    loss, report = tis(logprobs, None, batch, mask)
    w, _ = alg.tis_weights(batch["old_logprobs"], batch["rollout_logprobs"], mask, 1.5, 0.5)
    assert torch.allclose(loss, alg.sample_mean(per_token * w, mask), atol=1e-6)
    assert "tis_clip_fraction" in report
    assert not torch.allclose(loss, plain(logprobs, None, batch, mask)[0])
    opsm = PolicyObjective.from_config(_config("--use-opsm", "--opsm-delta", "0.05"))
    loss, report = opsm(logprobs, None, batch, mask)
    keep, _ = alg.opsm_mask(logprobs, batch["rollout_logprobs"], batch["advantages"], mask, delta=0.05)
    assert 0 < float(report["opsm_token_fraction"]) < 1
    assert torch.allclose(loss, alg.sample_mean(per_token * keep, mask), atol=1e-6)


def _hooks_module():
    mod = types.ModuleType("relax_test_training_hooks")

    def my_tis(pg_loss, train_logprobs, rollout_logprobs, mask):
        keep = (rollout_logprobs > -1.0).float() * mask
        return pg_loss * 2.0, keep, {"kept": keep.sum() / mask.sum()}

    def my_reducer(pg_loss, mask):
        return (pg_loss * mask).sum()

    def my_loss(logprobs, entropy, batch, mask):
        return -(logprobs * mask).sum() * 0.5, {"custom": 1.0}

    mod.my_tis, mod.my_reducer, mod.my_loss = my_tis, my_reducer, my_loss
    sys.modules[mod.__name__] = mod
    return mod


def test_custom_hooks_sft_and_mismatch_metrics():
    mod = _hooks_module()
    logprobs, batch, mask = _batch(2)
    per_token, _ = alg.ppo_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], mask, eps_clip=0.2,
                                       eps_clip_high=0.2)
    objective = PolicyObjective.from_config(_config(
        "--use-tis", "--custom-tis-function-path", f"{mod.__name__}.my_tis", "--get-mismatch-metrics",
        "--custom-pg-loss-reducer-function-path", f"{mod.__name__}.my_reducer"))
    loss, report = objective(logprobs, None, batch, mask)
    _, keep, _ = mod.my_tis(per_token, None, batch["rollout_logprobs"], mask)
    assert torch.allclose(loss, (per_token * 2.0 * keep).sum(), atol=1e-6)
    assert "tis_kept" in report
    expected = alg.mismatch_metrics(batch["old_logprobs"], batch["rollout_logprobs"], mask)
    assert torch.allclose(report["mismatch_k3_kl"], expected["k3_kl"])
    custom = PolicyObjective.from_config(_config("--loss-type", "custom_loss", "--custom-loss-function-path",
                                                 f"{mod.__name__}.my_loss"))
    loss, report = custom(logprobs, None, batch, mask)
    assert torch.allclose(loss, -(logprobs * mask).sum() * 0.5) and report == {"custom": 1.0}
    sft = PolicyObjective.from_config(_config("--loss-type", "sft"))
    loss, _ = sft(logprobs, None, batch, mask)
    assert torch.allclose(loss, alg.sample_mean(-logprobs, mask))


def test_estimators_and_kl_reward_shaping():
    samples = _samples()
    mask = response_mask(samples)
    rewards = torch.tensor([s.reward for s in samples])
    groups = torch.tensor([s.group_index for s in samples])
    lengths = [len(s.response_tokens) for s in samples]

    def stack(rows):
        return torch.stack([torch.nn.functional.pad(r, (0, mask.shape[1] - r.numel())) for r in rows])

    adv, _ = compute_advantages(samples, _config("--advantage-estimator", "reinforce_plus_plus_baseline",
                                                 "--normalize-advantages"))
    assert [a.numel() for a in adv] == lengths
    expected = alg.reinforce_plus_plus_baseline_advantages(rewards, groups, mask)
    assert torch.allclose(stack(adv), expected, atol=1e-5)
    # per-token: tokens of one sample differ under REINFORCE++ with gamma < 1
    adv, _ = compute_advantages(samples, _config("--advantage-estimator", "reinforce_plus_plus",
                                                 "--normalize-advantages", "--gamma", "0.9"))
    expected = alg.reinforce_plus_plus_advantages(rewards, mask, gamma=0.9)
    assert torch.allclose(stack(adv), expected, atol=1e-5)
    assert len(set(adv[2].tolist())) > 1
    # --kl-coef shapes the reward before the advantage: the group estimators normalise r - kl_coef * sum_t KL_t
    gen = torch.Generator().manual_seed(3)
    old = [-torch.rand(n, generator=gen) for n in lengths]
    ref = [-torch.rand(n, generator=gen) for n in lengths]
    kl = alg.kl_estimate(stack(old), stack(ref), "k3", mask=mask)
    shaped = rewards.double() - 0.5 * kl.double().sum(dim=-1)
    for est, expect in (("grpo", alg.grpo_advantages(shaped, groups)), ("gspo", alg.grpo_advantages(shaped, groups)),
                        ("rloo", alg.rloo_advantages(shaped, groups))):
        adv, metrics = compute_advantages(samples, _config("--advantage-estimator", est, "--kl-coef", "0.5",
                                                           "--kl-loss-type", "k3"), old_logprobs=old, ref_logprobs=ref)
        assert torch.allclose(stack(adv), alg.broadcast_to_tokens(expect, mask).float(), atol=1e-5), est
    assert metrics["kl_reward"] == pytest.approx(float(kl.sum() / mask.sum()), rel=1e-5)
    # (the old form, the GRPO advantage of the raw reward minus the KL return-to-go, differs)
    old_form = alg.discounted_returns(alg.kl_penalized_token_rewards(alg.grpo_advantages(rewards, groups), mask,
                                                                     kl=kl, kl_coef=0.5), mask)
    grpo_kl, _ = compute_advantages(samples, _config("--kl-coef", "0.5", "--kl-loss-type", "k3"), old_logprobs=old,
                                    ref_logprobs=ref)
    assert not torch.allclose(stack(grpo_kl), old_form, atol=1e-3)
    raw, _ = compute_advantages(samples, _config("--kl-coef", "0.5", "--kl-loss-type", "k3",
                                                 "--disable-rewards-normalization"), old_logprobs=old, ref_logprobs=ref)
    assert torch.allclose(stack(raw), alg.broadcast_to_tokens(shaped, mask).float(), atol=1e-6)
    adv, _ = compute_advantages(samples, _config("--advantage-estimator", "reinforce_plus_plus_baseline",
                                                 "--normalize-advantages", "--kl-coef", "0.5", "--kl-loss-type",
                                                 "k3"), old_logprobs=old, ref_logprobs=ref)
    centred = alg.broadcast_to_tokens(alg.group_mean_baseline(shaped, groups), mask)
    assert torch.allclose(stack(adv), alg.whiten(centred, mask).float(), atol=1e-5)
    # token-level estimators: -kl_coef * KL_t per token in the returns
    adv, _ = compute_advantages(samples, _config("--advantage-estimator", "reinforce_plus_plus",
                                                 "--normalize-advantages", "--kl-coef", "0.5", "--kl-loss-type",
                                                 "k3", "--gamma", "0.9"), old_logprobs=old, ref_logprobs=ref)
    tok = alg.kl_penalized_token_rewards(rewards, mask, kl=kl, kl_coef=0.5)
    assert torch.allclose(stack(adv), alg.whiten(alg.discounted_returns(tok, mask, 0.9), mask), atol=1e-5)
    plain, _ = compute_advantages(samples, _config())
    assert not torch.allclose(stack(grpo_kl), stack(plain))
    # --normalize-advantages whitens over all response tokens
    norm, _ = compute_advantages(samples, _config("--normalize-advantages"))
    assert torch.allclose(stack(norm), alg.whiten(stack(plain), mask), atol=1e-5)
    with pytest.raises(ValueError, match="kl-coef"):
        compute_advantages(samples, _config("--kl-coef", "0.5"))


@pytest.mark.parametrize("argv, match", [
    (["--ref-update-interval", "2"], "--ref-update-interval"),
    (["--use-unbiased-kl"], "--use-unbiased-kl"),
    (["--ref-ckpt-step", "3"], "--ref-ckpt-step"),
    (["--use-tis", "--use-rollout-logprobs"], "--use-rollout-logprobs"),
    (["--custom-tis-function-path", "relax.algorithms.tis_weights"], "--custom-tis-function-path"),
    (["--loss-type", "sft", "--use-tis"], "sft"),
    (["--use-kl-loss", "--resource", '{"actor": [1, 2], "rollout": [1, 1], "reference": [1, 1]}'], "reference"),
])
def test_rules(argv, match):
    with pytest.raises(ConfigError, match=match):
        _config(*argv)
