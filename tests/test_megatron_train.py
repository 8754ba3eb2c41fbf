"""Micro-batching, train steps and checkpoints of MegatronTrainer on one rank."""

import math

import pytest
import torch

from relax.backends.megatron.batching import make_micro_batches
from relax.backends.megatron.testing import hf_response_logprobs, hf_trainer, toy_pg_loss, toy_samples

torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("megatron_process")  # tests/megatron_fixtures.py
RANDOM_MODEL = dict(seed=5)  # the model of `model_dir` (tests/conftest.py)


def _trainer(path, **kw):
    return hf_trainer(path, **{"lr": 1e-3, "micro_batch_size": 2, "seed": 7, **kw})


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.export_hf_weights()}


def test_micro_batches_align_response_tokens():
    samples = [
        {"tokens": torch.tensor([5, 6, 7, 8, 9]), "response_length": 2,
         "adv": torch.tensor([1.0, 2.0]), "loss_mask": torch.tensor([1.0, 0.0]), "reward": 0.5},
        {"tokens": torch.tensor([1, 2, 3]), "response_length": 1,
         "adv": torch.tensor([3.0]), "loss_mask": torch.tensor([1.0]), "reward": 1.0},
        {"tokens": torch.tensor([4, 4, 4, 4]), "response_length": 3,
         "adv": torch.tensor([1.0, 1.0, 1.0]), "loss_mask": torch.ones(3), "reward": 0.0},
    ]
    mbs = make_micro_batches(samples, 2, pad_id=0, seq_multiple=4)
    assert [mb.size for mb in mbs] == [2, 1]
    mb = mbs[0]
    assert mb.tokens.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0]]
    assert mb.logit_index.tolist() == [[2, 3], [1, 0]]
    assert mb.targets.tolist() == [[8, 9], [3, 2]]
    assert mb.mask.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert mb.fields["adv"].tolist() == [[1.0, 2.0], [3.0, 0.0]]
    assert mb.fields["reward"].tolist() == [0.5, 1.0]
    with pytest.raises(ValueError, match="response_length"):
        make_micro_batches([{"tokens": torch.tensor([1, 2]), "response_length": 2}], 1)


def test_logprobs_match_hf_with_temperature(model_dir):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(model_dir)
    samples = toy_samples(5, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for temperature in (1.0, 0.6):
        ours = trainer.compute_logprobs(samples, temperature)
        ref = hf_response_logprobs(hf, samples, temperature)
        assert [t.shape for t in ours] == [t.shape for t in ref]
        assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < 1e-5


def test_train_step_updates_weights_and_schedules_lr(model_dir):
    trainer = _trainer(model_dir, lr_warmup_iters=2, lr_warmup_init=0.0)
    before = _weights(trainer)
    samples = toy_samples(6, seed=2)
    old = trainer.compute_logprobs(samples)
    for s, lp in zip(samples, old):
        s["old_logprobs"] = lp
    first = trainer.train_step(samples, toy_pg_loss)
    assert math.isfinite(first["loss"]) and math.isfinite(first["grad_norm"])
    assert first["grad_norm"] > 0
    assert abs(first["ratio_mean"] - 1.0) < 1e-5  # on-policy: ratio is exactly 1
    assert first["lr"] == pytest.approx(5e-4)  # half-way through the warm-up
    second = trainer.train_step(samples, toy_pg_loss)
    assert second["lr"] == pytest.approx(1e-3)
    assert trainer.train_step(samples, toy_pg_loss)["lr"] == pytest.approx(1e-3)
    assert second["loss"] < first["loss"]
    after = _weights(trainer)
    assert all(not torch.equal(before[k], after[k]) for k in before)
    assert trainer.iteration == 3


def test_warm_up_starts_at_lr_warmup_init(model_dir, tmp_path):
    from relax.config import parse_config
    from relax.roles.megatron_settings import trainer_settings

    config = parse_config(["--output-dir", str(tmp_path), "--lr", "1e-3", "--lr-warmup-iters", "2",
                           "--lr-warmup-init", "2e-4"])
    assert trainer_settings(config).lr_warmup_init == 2e-4
    trainer = _trainer(model_dir, lr_warmup_iters=2, lr_warmup_init=2e-4)
    samples = toy_samples(2, seed=2)
    assert trainer.train_step(samples, toy_pg_loss)["lr"] == pytest.approx(6e-4)  # 2e-4 + (1e-3 - 2e-4) / 2
    assert trainer.train_step(samples, toy_pg_loss)["lr"] == pytest.approx(1e-3)


def test_entropy_reaches_loss_fn(model_dir):
    trainer = _trainer(model_dir)
    samples = toy_samples(2, seed=3)

    def loss_fn(logprobs, entropy, batch, mask):
        assert entropy is not None and entropy.shape == logprobs.shape
        assert torch.all(entropy[mask > 0] > 0)
        return toy_pg_loss(logprobs, entropy, batch, mask)

    loss_fn.needs_entropy = True
    metrics = trainer.train_step(samples, loss_fn)
    assert metrics["entropy"] > 0


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_checkpoint_roundtrip(model_dir, tmp_path, distributed_optimizer):
    samples = toy_samples(4, seed=4)
    trainer = _trainer(model_dir, use_distributed_optimizer=distributed_optimizer,
                       lr_decay_style="linear", lr_decay_iters=10, min_lr=1e-4)
    trainer.train_step(samples, toy_pg_loss)
    ckpt = tmp_path / "ckpt"
    trainer.save_checkpoint(ckpt)
    trainer.save_checkpoint(ckpt)  # overwriting an existing checkpoint is atomic too
    assert (ckpt / "meta.json").exists() and not (tmp_path / "ckpt.tmp").exists()
    expected = trainer.train_step(samples, toy_pg_loss)
    expected_weights = _weights(trainer)

    other = _trainer(model_dir, use_distributed_optimizer=distributed_optimizer,
                     lr_decay_style="linear", lr_decay_iters=10, min_lr=1e-4)
    assert other.load_checkpoint(ckpt) == 1
    got = other.train_step(samples, toy_pg_loss)
    assert got == expected
    for name, tensor in _weights(other).items():
        assert torch.equal(tensor, expected_weights[name]), name


def test_bf16_step_is_finite(model_dir):
    trainer = _trainer(model_dir, bf16=True)
    metrics = trainer.train_step(toy_samples(2, seed=5), toy_pg_loss)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert all(t.dtype == torch.bfloat16 for _, t in trainer.export_hf_weights())


def test_recompute_and_logprob_chunking_do_not_change_training(model_dir):
    samples = toy_samples(4, seed=6)
    plain = _trainer(model_dir)
    fancy = _trainer(model_dir, recompute_activations=True, logprob_chunk_size=3)
    for _ in range(2):
        a = plain.train_step(samples, toy_pg_loss)
        b = fancy.train_step(samples, toy_pg_loss)
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), key
