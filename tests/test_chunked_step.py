"""One optimizer step over chunks (relax.backends.megatron.accumulate.ChunkedStep, --num-iters-per-train-update):
the step's samples given in 2 or 3 chunks, one after another, give the same loss, metrics, grad_norm,
gradients and weight update as one `MegatronTrainer.train_step` over the whole step, to float32 round-off
(1e-5 relative), for a per-token and a per-sample loss, with gradient clipping on, on one rank and on two
data-parallel ranks (each chunk split between them). No Ray."""

from __future__ import annotations

import pytest
import torch

from relax.backends.megatron.accumulate import ChunkedStep
from relax.formats.model_arch import ModelArch
from relax.backends.megatron.testing import build_random_tiny_model, ensure_single_process, run_ranks, toy_samples
from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings
from relax.training.objective import PolicyObjective

torch.set_num_threads(1)

N = 8  # samples of the step
CHUNKINGS = {"whole": [N], "halves": [4, 4], "uneven": [3, 2, 3]}


def _policy(per_token: bool) -> PolicyObjective:
    return PolicyObjective(estimator="grpo", eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, entropy_coef=0.01,
                           per_token_loss=per_token, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")


def _samples():
    samples = toy_samples(N, seed=4, min_len=4, max_len=22)
    gen = torch.Generator().manual_seed(8)
    for s in samples:
        s["ref_logprobs"] = -torch.rand(s["response_length"], generator=gen) * 3
    return samples


def _trainer(path):
    from transformers import AutoConfig

    # clipping at a norm the step exceeds: the clipped update must agree too. SGD: the update is lr times the
    # clipped gradient (Adam's first update, lr * g / (|g| + eps), turns round-off of gradients near 0 into
    # differences of up to 2 lr)
    settings = TrainerSettings(lr=1e-1, clip_grad=0.05, seed=7, micro_batch_size=3, optimizer="sgd",
                               sgd_momentum=0.0)
    trainer = MegatronTrainer(ModelArch.from_hf_config(AutoConfig.from_pretrained(path)), settings)
    trainer.load_hf(path)
    return trainer


def _state(trainer, metrics, before):
    grads = {k: p.main_grad.detach().clone() for k, p in trainer.gpt_model.named_parameters()}
    weights = {k: p.detach().clone() - before[k] for k, p in trainer.gpt_model.named_parameters()}
    weights["magnitude"] = torch.tensor(max(float(w.abs().max()) for w in before.values()))
    return metrics, grads, weights


def _runs(path, samples, rank=0, world=1):
    """{(per_token, chunking): (metrics, gradients, the update of the weights)} on this rank's share."""
    out = {}
    for per_token in (True, False):
        for chunking, sizes in CHUNKINGS.items():
            trainer = _trainer(path)
            before = {k: p.detach().clone() for k, p in trainer.gpt_model.named_parameters()}
            if chunking == "whole":
                metrics = trainer.train_step(samples[rank::world], _policy(per_token))
            else:
                step, start = ChunkedStep(trainer, _policy(per_token)), 0
                for j, size in enumerate(sizes):
                    step.add(samples[start:start + size][rank::world], last=j == len(sizes) - 1)
                    start += size
                metrics = step.finish()
            out[(per_token, chunking)] = _state(trainer, metrics, before)
    return out


def _dp_worker(rank, world, path, samples):
    from megatron.core import parallel_state as ps

    out = _runs(path, samples, rank, world)
    ps.destroy_model_parallel()
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = build_random_tiny_model(tmp_path_factory.mktemp("chunks") / "qwen2", "qwen2", seed=5)
    samples = _samples()
    dp2 = run_ranks(_dp_worker, 2, str(path), samples, timeout=300)[0]
    ensure_single_process()
    return {"dp1": _runs(path, samples), "dp2": dp2}


@pytest.mark.parametrize("per_token", [True, False])
def test_chunks_give_the_whole_step(runs, per_token):
    for layout, results in runs.items():
        want, want_grads, want_weights = results[(per_token, "whole")]
        assert want["loss"] != 0.0 and want["grad_norm"] > 0.05  # clipped
        scale = max(float(g.abs().max()) for g in want_grads.values())
        moved = max(float(w.abs().max()) for k, w in want_weights.items() if k != "magnitude")
        for chunking in CHUNKINGS:
            got, grads, weights = results[(per_token, chunking)]
            assert set(got) == set(want), (layout, chunking)
            for key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (layout, chunking, key)
            worst = max(float((grads[k] - want_grads[k]).abs().max()) for k in want_grads)
            assert worst <= 1e-5 * scale, (layout, chunking, worst / scale)
            worst = max(float((weights[k] - want_weights[k]).abs().max()) for k in want_weights)
            # the update is read back as (weights after - before) in float32: a few ulps of the weights
            assert worst <= 1e-5 * moved + 1e-6 * float(want_weights["magnitude"]), (layout, chunking, worst, moved)


def test_a_chunked_step_is_used_once(tmp_path):
    path = build_random_tiny_model(tmp_path / "qwen2", "qwen2", seed=5)
    trainer = _trainer(path)
    step = ChunkedStep(trainer, _policy(True))
    with pytest.raises(RuntimeError, match="at least one chunk"):
        step.finish()
    with pytest.raises(RuntimeError, match="no sample for this data-parallel rank"):
        step.add([], last=True)
    step.add(_samples(), last=True)
    step.finish()
    with pytest.raises(RuntimeError, match="optimizer step already"):
        step.add(_samples(), last=True)
