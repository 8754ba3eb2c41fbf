"""Trainer-side flags on one rank (real Megatron-core trainer over gloo, no Ray): --recompute-loss-function,
--keep-old-actor, --use-rollout-entropy and --true-on-policy-mode."""

import dataclasses
import sys
import types

import pytest
import torch

from megatron_fixtures import toy_rl_samples, trainer_config

from relax import algorithms as alg
from relax.backends.megatron.testing import hf_trainer
from relax.roles.megatron_settings import trainer_settings
from relax.training.advantages import trainer_inputs
from relax.training.objective import PolicyObjective
from relax.training.step import train_rollout

torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("megatron_process")  # tests/megatron_fixtures.py
RANDOM_MODEL = dict(seed=3)  # the model of `model_dir` (tests/conftest.py)

HOOKS = types.ModuleType("relax_test_training_flags_trainer_hooks")
HOOKS.seen = []


def _capture_loss(logprobs, entropy, batch, mask):
    HOOKS.seen.append({k: v.detach().clone() for k, v in batch.items()})
    return -(logprobs * mask).sum() / mask.sum(), {}


HOOKS.capture_loss = _capture_loss
sys.modules[HOOKS.__name__] = HOOKS


def _trainer(path, **kw):
    return hf_trainer(path, **{"lr": 1e-2, "micro_batch_size": 6, "seed": 7, **kw})


def _samples(n=6, seed=0):
    return toy_rl_samples(n, seed, min_response=3, response_spread=6)


def _config(*args):
    return trainer_config(*args, lr="1e-2")


def _capture_config(*args):
    return _config("--loss-type", "custom_loss", "--custom-loss-function-path", f"{HOOKS.__name__}.capture_loss", *args)


class _Counting:
    """A loss function that counts its calls (forward, and the recomputation in backward)."""

    def __init__(self, objective):
        self.objective, self.calls = objective, 0
        self.needs_entropy = objective.needs_entropy
        self.loss_weighting = objective.loss_weighting

    def __call__(self, *args):
        self.calls += 1
        return self.objective(*args)


def test_recompute_loss_function_gives_the_same_loss_and_gradients(model_dir):
    assert trainer_settings(_config("--recompute-loss-function")).recompute_loss_function
    assert not trainer_settings(_config()).recompute_loss_function
    trainer = _trainer(model_dir, lr=0.0, micro_batch_size=3)  # lr 0: both passes see the same weights
    samples = _samples()
    gen = torch.Generator().manual_seed(1)
    inputs = trainer_inputs(samples, torch.randn(6, generator=gen))
    for x in inputs:
        x["old_logprobs"] = x["rollout_logprobs"] * 0.1
    objective = PolicyObjective.from_config(_config("--entropy-coef", "0.01"))
    results = {}
    for recompute in (False, True):
        trainer.settings = dataclasses.replace(trainer.settings, recompute_loss_function=recompute)
        loss_fn = _Counting(objective)
        out = trainer.train_step(inputs, loss_fn)
        grads = {k: v.main_grad.detach().clone() for k, v in trainer.gpt_model.named_parameters()}
        results[recompute] = (out, grads, loss_fn.calls)
    (plain, g0, calls0), (recomputed, g1, calls1) = results[False], results[True]
    assert calls0 == 2 and calls1 == 4  # 2 micro-batches; with recompute each loss runs again in backward
    assert recomputed["loss"] == pytest.approx(plain["loss"], rel=1e-6, abs=1e-7)
    assert recomputed["entropy"] == pytest.approx(plain["entropy"], rel=1e-6)
    assert recomputed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5) and plain["grad_norm"] > 0
    for name in g0:
        assert torch.allclose(g0[name], g1[name], rtol=1e-5, atol=1e-7), name


def test_keep_old_actor_computes_old_logprobs_with_the_kept_weights(model_dir):
    trainer = _trainer(model_dir)
    samples = _samples()
    base = trainer_inputs(samples, [0.0] * 6)
    with pytest.raises(RuntimeError, match="--keep-old-actor"):
        train_rollout(trainer, samples, _capture_config("--keep-old-actor"), step=0)
    trainer.keep_weights("old_actor")  # what TrainerWorker does at setup and at every weight push
    rollout_policy = trainer.compute_logprobs(base)
    train_rollout(trainer, samples, _config(), step=0)  # the actor moves on; the engines are not updated
    moved = trainer.compute_logprobs(base)
    assert max(float((a - b).abs().max()) for a, b in zip(moved, rollout_policy)) > 1e-3
    HOOKS.seen.clear()
    train_rollout(trainer, samples, _capture_config("--keep-old-actor"), step=1)
    olds = HOOKS.seen[0]["old_logprobs"]
    for i, row in enumerate(rollout_policy):
        assert torch.allclose(olds[i, :len(row)], row, atol=1e-6)  # the pre-update weights' log-probs
    # without the flag, one update per step uses the current log-probs (no old log-probs at all)
    HOOKS.seen.clear()
    train_rollout(trainer, samples, _capture_config(), step=2)
    assert "old_logprobs" not in HOOKS.seen[0]
    # the kept weights were only swapped in: the current ones are back, exactly
    now = trainer.compute_logprobs(base)
    again = trainer.compute_logprobs(base, weights="old_actor")
    after = trainer.compute_logprobs(base)
    for a, b, c in zip(now, after, again):
        assert torch.equal(a, b)
    for a, b in zip(again, rollout_policy):
        assert torch.allclose(a, b, atol=1e-6)


def _hf_entropy(model_dir, samples):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.tokens])).logits[0].float()
            n = len(s.response_tokens)
            logp = torch.log_softmax(logits[-n - 1:-1], dim=-1)
            rows.append(-(logp.exp() * logp).sum(-1))
    return rows


def test_use_rollout_entropy_comes_from_the_logprob_pass(model_dir):
    trainer = _trainer(model_dir)
    samples = _samples()
    expected = _hf_entropy(model_dir, samples)  # the entropy formula under the weights that made the samples
    objective = PolicyObjective.from_config(_config("--use-rollout-entropy"))
    assert objective.needs_entropy is False  # the training pass skips it: no entropy bonus
    assert PolicyObjective.from_config(_config("--use-rollout-entropy", "--entropy-coef", "0.1")).needs_entropy
    HOOKS.seen.clear()
    train_rollout(trainer, samples, _capture_config("--use-rollout-entropy"), step=0)
    got = HOOKS.seen[0]["old_entropy"]
    for i, row in enumerate(expected):
        assert torch.allclose(got[i, :len(row)], row, atol=1e-4), (got[i], row)
    # the train/entropy metric is the reduced entropy of that pass (the weights moved since: recompute with
    # the kept copy to get the metric's input)
    trainer.keep_weights("old_actor")
    _, ent = trainer.compute_logprobs_and_entropy(trainer_inputs(samples, [0.0] * 6))
    out = train_rollout(trainer, samples, _config("--use-rollout-entropy", "--keep-old-actor"), step=1)
    mask = torch.stack([torch.nn.functional.pad(torch.ones(len(r)), (0, 8 - len(r))) for r in ent])
    padded = torch.stack([torch.nn.functional.pad(r, (0, 8 - len(r))) for r in ent])
    assert out["train/entropy"] == pytest.approx(float(alg.sample_mean(padded, mask)), rel=1e-5)


def test_true_on_policy_mode_checks_and_uses_the_engine_logprobs(model_dir):
    trainer = _trainer(model_dir)
    samples = _samples()
    exact = trainer.compute_logprobs(trainer_inputs(samples, [0.0] * 6))
    for s, row in zip(samples, exact):  # an engine that matches the trainer (float32: ~1e-6 in real runs)
        s.response_logprobs = (row + 1e-6).tolist()
    HOOKS.seen.clear()
    out = train_rollout(trainer, samples, _capture_config("--true-on-policy-mode"), step=0)
    assert 0 < out["train/true_on_policy_max_abs_diff"] < 1e-5
    olds = HOOKS.seen[0]["old_logprobs"]
    for i, s in enumerate(samples):  # the old policy is the engine's log-probs
        assert torch.allclose(olds[i, :len(s.response_logprobs)], torch.tensor(s.response_logprobs))
    # one perturbed token: the run stops naming step, sample and token (the weights moved: re-sync the samples)
    exact = trainer.compute_logprobs(trainer_inputs(samples, [0.0] * 6))
    for s, row in zip(samples, exact):
        s.response_logprobs = row.tolist()
    samples[4].response_logprobs[1] += 0.01
    before = trainer.compute_logprobs(trainer_inputs(samples, [0.0] * 6))
    with pytest.raises(RuntimeError, match=r"step 3: --true-on-policy-mode: sample 4 token 1: .* by 0\.01"):
        train_rollout(trainer, samples, _config("--true-on-policy-mode"), step=3)
    after = trainer.compute_logprobs(trainer_inputs(samples, [0.0] * 6))
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # no update was made
    # a token outside the loss mask is not checked
    samples[4].loss_mask[1] = 0
    out = train_rollout(trainer, samples, _config("--true-on-policy-mode"), step=4)
    assert out["train/true_on_policy_max_abs_diff"] < 1e-5
