"""Context parallelism (--context-parallel-size 2, gloo, Megatron's local layer spec with
relax.backends.megatron.context_parallel's attention): two ranks, each holding two of the four chunks of every
sequence, give one rank's log-probs, losses, gradient norms and updated weights; a critic's values too."""

import pytest
import torch
from megatron.core import parallel_state as ps

from relax.backends.megatron.context_parallel import ContextParallelAttention, local_positions
from relax.backends.megatron.testing import (build_random_tiny_model, ensure_single_process, hf_trainer, run_ranks,
                                             toy_pg_loss, toy_samples)

torch.set_num_threads(1)

BASE = dict(lr=1e-3, micro_batch_size=2, seed=11, clip_grad=1.0, weight_decay=0.01)
STEPS = 2


def _run(path, samples, **layout):
    trainer = hf_trainer(path, **BASE, **layout)
    return {"cp_attention": sum(isinstance(m, ContextParallelAttention) for m in trainer.gpt_model.modules()),
            "logprobs": trainer.compute_logprobs(samples, 0.8),
            "metrics": [trainer.train_step(samples, toy_pg_loss, 0.8) for _ in range(STEPS)],
            "weights": dict(trainer.export_hf_weights())}


def _worker(rank, world, path, samples):
    out = _run(path, samples, cp=2)
    out["cp_comm_type"] = hf_trainer(path, **BASE, cp=2, allgather_cp=True).config.cp_comm_type
    out["cp_rank"] = ps.get_context_parallel_rank()
    out["dp"] = ps.get_data_parallel_world_size()
    return out


@pytest.fixture(scope="module")
def model_and_samples(tmp_path_factory):
    path = build_random_tiny_model(tmp_path_factory.mktemp("cp") / "qwen2", "qwen2", seed=21)
    return str(path), toy_samples(4, seed=9)


def test_load_balanced_chunks():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="multiple of 2 x context-parallel size"):
        local_positions(6, 2, 0)


def test_context_parallel_matches_one_rank(model_and_samples):
    path, samples = model_and_samples
    ranks = run_ranks(_worker, 2, path, samples, timeout=300)
    ensure_single_process()
    ref = _run(path, samples)
    assert sorted(r["cp_rank"] for r in ranks) == [0, 1] and all(r["dp"] == 1 for r in ranks)
    assert all(r["cp_comm_type"] == "all_gather" for r in ranks)  # --allgather-cp, for TE's attention on GPU
    assert ref["cp_attention"] == 0 and all(r["cp_attention"] > 0 for r in ranks)  # one per layer under CP
    for out in ranks:
        for a, b in zip(ref["logprobs"], out["logprobs"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        for want, got in zip(ref["metrics"], out["metrics"]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        # Adam divides each gradient element by its own running scale, so an element whose gradient is near the
        # rounding noise of the two layouts' different reduction orders moves by a different fraction of the
        # learning rate: on an AVX512 machine one of 4096 elements differed by 5.5e-6 after two steps at lr 1e-3.
        # Weights agree to 1% of one step's learning rate; the log-probs, losses and gradient norms above stay tight.
        for key, tensor in ref["weights"].items():
            torch.testing.assert_close(out["weights"][key], tensor, rtol=1e-5, atol=1e-2 * BASE["lr"])


def test_context_parallel_layouts_checked_before_ray(tmp_path, tiny_model):
    from relax.backends.megatron.testing import build_random_tiny_moe_model
    from relax.config import ConfigError, parse_config
    from relax.config.support import require_supported

    base = ["--output-dir", str(tmp_path / "run"), "--context-parallel-size", "2"]
    config = parse_config(base + ["--hf-checkpoint", tiny_model, "--resource", '{"actor": [1, 2], "rollout": [1, 1]}'])
    assert config.context_parallel_size == 2
    require_supported(config)  # no "not supported yet": a real run builds it
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 2 is not supported yet"):
        parse_config(base + ["--hf-checkpoint", tiny_model, "--pipeline-model-parallel-size", "2",
                             "--resource", '{"actor": [1, 4], "rollout": [1, 1]}'])
    moe = build_random_tiny_moe_model(tmp_path / "moe", seed=4)
    with pytest.raises(ConfigError, match="MoE model"):
        parse_config(base + ["--hf-checkpoint", str(moe), "--resource", '{"actor": [1, 2], "rollout": [1, 1]}'])
