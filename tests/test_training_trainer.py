"""Trainer-side features on one rank (no Ray): KL loss through a real model, dynamic batch size, parameter
freezing, optimizer reset, NaN/Inf stops, forward-only reference loading from checkpoints."""

import dataclasses

import pytest
import torch

from megatron_fixtures import toy_rl_samples, trainer_config

from relax.backends.megatron.testing import hf_trainer, toy_samples
from relax.training.objective import PolicyObjective
from relax.training.step import train_rollout

torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("megatron_process")  # tests/megatron_fixtures.py
RANDOM_MODEL = dict(seed=3)  # the model of `model_dir` (tests/conftest.py)


def _trainer(path, **kw):
    return hf_trainer(path, **{"lr": 1e-3, "micro_batch_size": 2, "seed": 7, **kw})


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.gpt_model.named_parameters()}


def _grads(trainer):
    """The gradients of the last train_step (Megatron keeps them in main_grad until the next one)."""
    return {k: v.main_grad.detach().clone() for k, v in trainer.gpt_model.named_parameters()}


_samples = toy_rl_samples
_config = trainer_config


def test_kl_loss_metric_is_the_formula_under_the_real_model(model_dir):
    from relax import algorithms as alg
    from relax.training.advantages import trainer_inputs

    trainer = _trainer(model_dir, micro_batch_size=6)
    samples = _samples()
    gen = torch.Generator().manual_seed(9)
    ref = [(-torch.rand(len(s.response_tokens), generator=gen) * 3).tolist() for s in samples]
    current = trainer.compute_logprobs(trainer_inputs(samples, [0.0] * 6), 1.0)
    width = max(len(r) for r in ref)
    pad = lambda rows: torch.stack([torch.nn.functional.pad(torch.as_tensor(r), (0, width - len(r))) for r in rows])
    mask = pad([torch.ones(len(r)) for r in ref])
    expected = alg.sample_mean(alg.kl_estimate(pad(current), pad(ref), "k3", mask=mask), mask)
    config = _config("--use-kl-loss", "--kl-loss-coef", "0.5", "--kl-loss-type", "k3")
    with pytest.raises(RuntimeError, match="reference"):
        train_rollout(trainer, samples, config, step=0)
    out = train_rollout(trainer, [dataclasses.replace(s, ref_logprobs=r) for s, r in zip(samples, ref)], config,
                        step=0)
    assert out["train/kl"] == pytest.approx(float(expected), rel=1e-4)
    plain = _trainer(model_dir, micro_batch_size=6)
    base = train_rollout(plain, samples, _config(), step=0)
    # the KL term moves the loss by exactly coef * KL (same weights, on-policy)
    assert out["train/loss"] - base["train/loss"] == pytest.approx(0.5 * float(expected), rel=1e-3)


def test_dynamic_batch_size_gives_the_same_update(model_dir):
    samples = [dict(s, advantages=s["advantages"] * 0 + i - 2.5) for i, s in enumerate(toy_samples(6, seed=4))]
    objective = PolicyObjective(estimator="grpo", eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None,
                                entropy_coef=0.0, per_token_loss=False)
    for per_token in (False, True):
        objective.reduction = "token_mean" if per_token else "sample_mean"
        objective.loss_weighting = "tokens" if per_token else "samples"
        one = _trainer(model_dir, micro_batch_size=6)
        packed = _trainer(model_dir, max_tokens_per_micro_batch=40)
        mbs = packed._micro_batches(samples, 40)
        assert len(mbs) >= 3 and len({mb.size for mb in mbs}) > 1  # uneven packing
        assert all(mb.size * mb.seq_length <= 40 or mb.size == 1 for mb in mbs)
        a = one.train_step(samples, objective)
        b = packed.train_step(samples, objective)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        ga, gb = _grads(one), _grads(packed)
        scale = max(float(g.abs().max()) for g in ga.values())
        assert max(float((ga[k] - gb[k]).abs().max()) for k in ga) < 1e-5 * scale
    # fixed micro-batches are weighted by their share of the step too (uneven 4 + 2 split)
    fixed = _trainer(model_dir, micro_batch_size=4)
    c = fixed.train_step(samples, objective)
    assert c["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert c["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_frozen_parameters_do_not_change(model_dir):
    trainer = _trainer(model_dir, frozen_params=(r"embedding", r"layers\.0\."))
    before = _params(trainer)
    objective = PolicyObjective(estimator="grpo", eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None,
                                entropy_coef=0.0, per_token_loss=False)
    trainer.train_step(toy_samples(4, seed=1), objective)
    after = _params(trainer)
    frozen = {k for k in before if "embedding" in k or "layers.0." in k}
    assert frozen and frozen == trainer.frozen_names
    assert all(torch.equal(before[k], after[k]) for k in frozen)
    assert all(not torch.equal(before[k], after[k]) for k in before if k not in frozen)
    only = _trainer(model_dir, trainable_params=(r"output_layer",))
    assert only.frozen_names == {k for k in before if "output_layer" not in k}
    with pytest.raises(ValueError, match="matches no parameter"):
        _trainer(model_dir, frozen_params=("no_such_param",))


def test_reset_optimizer_states_acts_like_a_fresh_optimizer(model_dir):
    objective = PolicyObjective(estimator="grpo", eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None,
                                entropy_coef=0.0, per_token_loss=False)
    first, second = toy_samples(4, seed=1), toy_samples(4, seed=2)
    trainer = _trainer(model_dir)
    trainer.train_step(first, objective)
    trainer.reset_optimizer_states()
    fresh = _trainer(model_dir)
    fresh.set_model_state(trainer.model_state())
    trainer.train_step(second, objective)
    fresh.train_step(second, objective)
    pa, pb = _params(trainer), _params(fresh)
    assert max(float((pa[k] - pb[k]).abs().max()) for k in pa) < 1e-6
    kept = _trainer(model_dir)  # without the reset the second update differs
    kept.train_step(first, objective)
    kept.train_step(second, objective)
    pc = _params(kept)
    assert max(float((pa[k] - pc[k]).abs().max()) for k in pa) > 1e-5


def test_nan_loss_or_gradient_stops_the_step(model_dir):
    trainer = _trainer(model_dir)
    before = _params(trainer)

    def nan_loss(logprobs, entropy, batch, mask):
        return (logprobs * mask).sum() * float("nan"), {}

    def nan_grad(logprobs, entropy, batch, mask):
        x = logprobs.clone()
        x.register_hook(lambda g: g * float("nan"))
        return -(x * mask).sum(), {}

    with pytest.raises(FloatingPointError, match="train/loss is nan"):
        trainer.train_step(toy_samples(2), nan_loss)
    with pytest.raises(FloatingPointError, match="train/grad_norm"):
        trainer.train_step(toy_samples(2), nan_grad)
    after = _params(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)
    samples = _samples()
    samples[2].response_logprobs = [float("inf")] * len(samples[2].response_tokens)  # engine garbage -> TIS inf
    samples[2].reward = float("nan")
    with pytest.raises(FloatingPointError, match=r"step 5 .*train/loss"):
        train_rollout(trainer, samples, _config("--disable-rewards-normalization"), step=5)
    assert all(torch.equal(before[k], v) for k, v in _params(trainer).items())


def test_forward_only_reference_loads_relax_checkpoints_and_hf(model_dir, tmp_path):
    trainer = _trainer(model_dir)
    objective = PolicyObjective(estimator="grpo", eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None,
                                entropy_coef=0.0, per_token_loss=False)
    trainer.train_step(toy_samples(4, seed=1), objective)
    root = tmp_path / "ckpt"
    trainer.save_checkpoint(root / "iter_0000003" / "actor")
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    probe = toy_samples(3, seed=8)
    want = trainer.compute_logprobs(probe)
    for source in (root, root / "iter_0000003", root / "iter_0000003" / "actor"):
        ref = _trainer(model_dir, forward_only=True)
        assert ref.optimizer is None and not any(p.requires_grad for p in ref.gpt_model.parameters())
        assert ref.load_weights(source) == "relax"
        got = ref.compute_logprobs(probe)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))
    ref = _trainer(model_dir, forward_only=True)
    assert ref.load_weights(model_dir) == "hf"
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ref.compute_logprobs(probe), want))
    with pytest.raises(FileNotFoundError, match="iteration 9"):
        ref.load_weights(root, step=9)
    # the reference saves and reloads its (refreshed) weights without an optimizer
    ref.set_model_state(trainer.model_state())
    ref.save_checkpoint(tmp_path / "refsave")
    again = _trainer(model_dir, forward_only=True)
    again.load_checkpoint(tmp_path / "refsave")
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(again.compute_logprobs(probe), want))
