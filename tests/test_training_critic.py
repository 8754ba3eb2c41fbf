"""Critic (value head) and PPO / OPD advantage wiring on one rank (no Ray), against formulas written out here."""

import dataclasses

import pytest
import torch

from megatron_fixtures import toy_rl_samples, trainer_config

from relax.backends.megatron.testing import hf_trainer
from relax.config.errors import ConfigError
from relax.training.advantages import compute_advantages_and_returns, trainer_inputs
from relax.training.step import train_critic, train_rollout

torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("megatron_process")  # tests/megatron_fixtures.py
RANDOM_MODEL = dict(seed=3)  # the model of `model_dir` (tests/conftest.py)


def _trainer(path, **kw):
    return hf_trainer(path, **{"lr": 1e-3, "micro_batch_size": 2, "seed": 7, **kw})


def _samples(n=6, seed=0):
    return toy_rl_samples(n, seed, tool_token=True)  # a tool token inside the longer responses


_config = trainer_config


def _rand_rows(samples, seed, scale=1.0, negative=False):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for s in samples:
        r = torch.rand(len(s.response_tokens), generator=gen) * scale
        rows.append((-r if negative else r).tolist())
    return rows


# --------------------------------------------------------------------------- value head


def test_value_head_is_a_linear_read_of_the_final_hidden_states(model_dir):
    from transformers import AutoModelForCausalLM

    critic = _trainer(model_dir, value_head=True)
    names = [n for n, _ in critic.gpt_model.named_parameters()]
    assert "output_layer.value.weight" in names and "output_layer.weight" not in names
    samples = trainer_inputs(_samples(), [0.0] * 6)
    values = critic.compute_values(samples)
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    head = critic.gpt_model.output_layer.value
    for sample, v in zip(samples, values):
        tokens, r = sample["tokens"], sample["response_length"]
        n = tokens.numel()
        with torch.no_grad():
            h = hf(tokens.unsqueeze(0), output_hidden_states=True).hidden_states[-1][0]  # after the final norm
            expected = (h @ head.weight.T + head.bias).squeeze(-1)[n - r - 1:n - 1]  # state before each token
        assert v.shape == (r,)
        torch.testing.assert_close(v, expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="value_head"):
        _trainer(model_dir).compute_values(samples)


def test_critic_update_is_the_clipped_value_loss_and_fits_returns(model_dir):
    from relax import algorithms as alg

    critic = _trainer(model_dir, value_head=True, micro_batch_size=6, lr=1e-2)
    samples = _samples()
    config = _config("--advantage-estimator", "ppo", "--value-clip", "0.05")
    current = critic.compute_values(trainer_inputs(samples, [0.0] * 6))
    old = [(v + 0.1 * (-1) ** i).tolist() for i, v in enumerate(current)]  # so that the clip binds somewhere
    returns = _rand_rows(samples, 5, scale=2.0)
    width = max(len(r) for r in returns)
    pad = lambda rows: torch.stack([torch.nn.functional.pad(torch.as_tensor(r, dtype=torch.float32),
                                                            (0, width - len(r))) for r in rows])
    mask = pad([s.loss_mask for s in samples])
    per_token, m = alg.value_loss(pad(current), pad(old), pad(returns), mask, value_clip=0.05)
    expected = float(alg.sample_mean(per_token, mask))
    assert 0 < float(m["clip_fraction"]) < 1
    before = {k: v.detach().clone() for k, v in critic.gpt_model.named_parameters()}
    out = train_critic(critic, _with(samples, values=old, returns=returns), config, step=0)
    assert out["critic/value_loss"] == pytest.approx(expected, rel=1e-4)
    assert out["critic/clip_fraction"] == pytest.approx(float(m["clip_fraction"]), abs=1e-6)
    assert out["critic/values_mean"] == pytest.approx(float((pad(current) * mask).sum() / mask.sum()), rel=1e-4)
    assert out["critic/grad_norm"] > 0 and out["critic/lr"] == pytest.approx(1e-2)
    after = dict(critic.gpt_model.named_parameters())
    assert not torch.equal(before["output_layer.value.weight"], after["output_layer.value.weight"])
    body = "decoder.layers.0.mlp.linear_fc1.weight"
    assert not torch.equal(before[body], after[body])
    losses = [out["critic/value_loss"]]
    for _ in range(6):  # unclipped regression on fixed targets goes down
        vals = [v.tolist() for v in critic.compute_values(trainer_inputs(samples, [0.0] * 6))]
        losses.append(train_critic(critic, _with(samples, values=vals, returns=returns),
                                   _config("--advantage-estimator", "ppo", "--value-clip", "100"))["critic/value_loss"])
    assert losses[-1] < 0.5 * losses[1], losses


def test_critic_lr_and_warmup_come_from_the_critic_flags():
    from relax.roles.critic import critic_settings

    s = critic_settings(_config("--advantage-estimator", "ppo", "--critic-lr", "3e-4", "--critic-lr-warmup-iters", "4",
                                "--lr-warmup-iters", "1"))
    assert s.value_head and s.lr == pytest.approx(3e-4) and s.lr_warmup_iters == 4
    long_warmup = critic_settings(_config("--advantage-estimator", "ppo", "--num-rollout", "2",
                                          "--critic-lr-warmup-iters", "5"))
    assert long_warmup.lr_decay_iters == 6  # beyond the critic's warm-up (the actor's run is 2 steps)
    assert critic_settings(_config("--advantage-estimator", "ppo")).lr == pytest.approx(1e-3)  # from --lr


# --------------------------------------------------------------------------- GAE / OPD wiring


def _gae_by_hand(rewards, values, masks, gamma, lam):
    """Per sample, over the masked positions only (unmasked ones get 0): textbook GAE."""
    advs, rets = [], []
    for r, v, m in zip(rewards, values, masks):
        idx = [t for t, keep in enumerate(m) if keep]
        a = [0.0] * len(m)
        g = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = v[idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = r[t] + gamma * next_v - v[t]
            g = delta + gamma * lam * g
            a[t] = g
        advs.append(a)
        rets.append([a[t] + v[t] if m[t] else 0.0 for t in range(len(m))])
    return advs, rets


def test_ppo_advantages_are_gae_over_kl_shaped_token_rewards():
    samples = _samples()
    config = _config("--advantage-estimator", "ppo", "--gamma", "0.9", "--lambd", "0.8", "--kl-coef", "0.3",
                     "--kl-loss-type", "k1")
    values = _rand_rows(samples, 1)
    old = _rand_rows(samples, 2, scale=3.0, negative=True)
    ref = _rand_rows(samples, 3, scale=3.0, negative=True)
    adv, returns, metrics = compute_advantages_and_returns(
        samples, config, old_logprobs=[torch.tensor(r) for r in old], ref_logprobs=[torch.tensor(r) for r in ref],
        values=[torch.tensor(v) for v in values])
    token_rewards = []
    for s, o, rf in zip(samples, old, ref):
        m = s.loss_mask
        tr = [-0.3 * (o[t] - rf[t]) if m[t] else 0.0 for t in range(len(m))]  # k1: log pi - log pi_ref
        tr[max(t for t in range(len(m)) if m[t])] += s.reward  # reward on the last (masked) token
        token_rewards.append(tr)
    exp_adv, exp_ret = _gae_by_hand(token_rewards, values, [s.loss_mask for s in samples], 0.9, 0.8)
    for a, r, ea, er in zip(adv, returns, exp_adv, exp_ret):
        torch.testing.assert_close(a, torch.tensor(ea), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r, torch.tensor(er), atol=1e-5, rtol=1e-5)
    assert metrics["kl_reward"] != 0
    with pytest.raises(ValueError, match="critic"):
        compute_advantages_and_returns(samples, _config("--advantage-estimator", "ppo"))


def test_opd_term_is_added_to_any_estimator():
    samples = _samples()
    old = [torch.tensor(r) for r in _rand_rows(samples, 2, scale=3.0, negative=True)]
    teacher = [torch.tensor(r) for r in _rand_rows(samples, 4, scale=3.0, negative=True)]
    base, _, _ = compute_advantages_and_returns(samples, _config())
    args = ("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/nowhere", "--opd-kl-coef", "0.7")
    adv, returns, metrics = compute_advantages_and_returns(samples, _config(*args), old_logprobs=old,
                                                           teacher_logprobs=teacher)
    assert returns is None
    for s, a, b, o, t in zip(samples, adv, base, old, teacher):
        m = torch.tensor(s.loss_mask, dtype=torch.float32)
        torch.testing.assert_close(a, b + 0.7 * (t - o) * m)
    with pytest.raises(ValueError, match="teacher"):
        compute_advantages_and_returns(samples, _config(*args), old_logprobs=old)


def test_train_rollout_ppo_hands_returns_to_the_critic_and_respects_critic_only_steps(model_dir):
    actor = _trainer(model_dir, micro_batch_size=6)
    samples = _samples()
    values = _rand_rows(samples, 1)
    config = _config("--advantage-estimator", "ppo", "--gamma", "0.95", "--lambd", "0.9",
                     "--num-critic-only-steps", "1")
    with pytest.raises(RuntimeError, match="critic"):
        train_rollout(actor, samples, config, step=0)
    with pytest.raises(RuntimeError, match="response tokens"):
        train_rollout(actor, _with(samples, values=[v[:-1] for v in values]), config, step=0)
    before = {k: v.detach().clone() for k, v in actor.gpt_model.named_parameters()}
    scored = _with(samples, values=values)
    out = train_rollout(actor, scored, config, step=0)  # a critic-only step
    assert out["train/num_updates"] == 0 and "train/loss" not in out
    assert all(torch.equal(before[k], v) for k, v in actor.gpt_model.named_parameters())
    token_rewards = []
    for s in samples:
        tr = [0.0] * len(s.loss_mask)
        tr[max(t for t in range(len(tr)) if s.loss_mask[t])] = s.reward
        token_rewards.append(tr)
    _, exp_ret = _gae_by_hand(token_rewards, values, [s.loss_mask for s in samples], 0.95, 0.9)
    for got, exp in zip([s.returns for s in scored], exp_ret):  # the returns the critic's update reads
        assert got == pytest.approx(exp, abs=1e-5)
    out = train_rollout(actor, _with(samples, values=values), config, step=1)  # the actor trains from step 1 on
    assert out["train/num_updates"] == 1 and out["train/grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in actor.gpt_model.named_parameters())


def _with(samples, **rows):
    """Copies of `samples` carrying stage fields, as a read of the data plane gives them."""
    return [dataclasses.replace(s, **{k: list(v[i]) for k, v in rows.items()}) for i, s in enumerate(samples)]


# --------------------------------------------------------------------------- flags


def test_critic_and_opd_flag_rules():
    for args, match in [(["--lambd", "0.9"], "ppo"), (["--critic-lr", "1e-5"], "ppo"), (["--critic-save", "/x"], "ppo"),
                        (["--opd-kl-coef", "0.5"], "--use-opd"), (["--opd-teacher-load", "/x"], "--use-opd"),
                        (["--use-opd", "--opd-type", "megatron", "--opd-teacher-ckpt-step", "3",
                          "--opd-teacher-load", "/x", "--resource", '{"actor": [1, 2], "rollout": [1, 1], '
                                                                     '"teacher": [1, 1]}'], "teacher"),
                        (["--advantage-estimator", "ppo", "--resource",
                          '{"actor": [1, 2], "rollout": [1, 1], "critic": [1, 1]}'], "critic")]:
        with pytest.raises(ConfigError, match=match):
            _config(*args)
    config = _config("--advantage-estimator", "ppo", "--lambd", "0.95", "--num-critic-only-steps", "2")
    assert config.critic_lr == config.lr
    from relax.config.support import unsupported_flags

    assert unsupported_flags(config) == []
    opd = _config("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/x", "--opd-kl-coef", "0.5")
    assert unsupported_flags(opd) == []
    sglang = _config("--use-opd", "--opd-type", "sglang", "--rm-url", "http://127.0.0.1:1")  # tests/test_opd_sglang.py
    assert unsupported_flags(sglang) == []
