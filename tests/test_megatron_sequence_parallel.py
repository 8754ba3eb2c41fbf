"""Sequence parallelism (TP=2, gloo, Megatron's local layer spec): the same log-probs, losses, gradient norms and
exported weights as TP=2 without it, with the norms' weights marked and their gradients summed over the
tensor-parallel group (relax.backends.megatron.sequence_parallel)."""

import pytest
import torch

from relax.backends.megatron.testing import build_random_tiny_model, hf_trainer, run_ranks, toy_pg_loss, toy_samples
from relax.config import ConfigError, parse_config
from relax.config.support import require_supported

torch.set_num_threads(1)

BASE = dict(lr=1e-3, micro_batch_size=2, seed=11, clip_grad=1.0, weight_decay=0.01, tp=2)
STEPS = 2


def _worker(rank, world, path, samples):
    from megatron.core import parallel_state as ps

    out = {}
    for name, sp in (("plain", False), ("sp", True)):
        trainer = hf_trainer(path, **BASE, sequence_parallel=sp)
        marked = [p for p in trainer.gpt_model.parameters() if getattr(p, "sequence_parallel", False)]
        out[name] = {
            "active": trainer.config.sequence_parallel, "marked": len(marked),
            "logprobs": trainer.compute_logprobs(samples, 0.8),
            "metrics": [trainer.train_step(samples, toy_pg_loss, 0.8) for _ in range(STEPS)],
            "norms_after": [p.detach().clone() for n, p in trainer.gpt_model.named_parameters() if "norm" in n],
            "weights": dict(trainer.export_hf_weights()),
        }
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = build_random_tiny_model(tmp_path_factory.mktemp("sp") / "qwen2", "qwen2", seed=21)
    return run_ranks(_worker, 2, str(path), toy_samples(4, seed=9), timeout=300)


def test_sequence_parallel_matches_tensor_parallel_alone(ranks):
    for rank in ranks:
        plain, sp = rank["plain"], rank["sp"]
        assert not plain["active"] and plain["marked"] == 0
        assert sp["active"] and sp["marked"] > 0  # every norm of the layers and the final norm
        for a, b in zip(plain["logprobs"], sp["logprobs"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        for ma, mb in zip(plain["metrics"], sp["metrics"]):
            assert mb["loss"] == pytest.approx(ma["loss"], rel=1e-6, abs=1e-7)
            assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-6)
        assert plain["weights"].keys() == sp["weights"].keys()
        # what a weight push would send to the engines; float32 round-off apart: without sequence parallelism the LM
        # head runs on the response rows alone (relax.backends.megatron.response_positions), with it on every
        # position, so the two matmuls round differently (seen: 4e-7 on a weight of 0.08 after 2 updates; a missing
        # gradient reduction over the tensor-parallel ranks is off by orders of magnitude more)
        for key, tensor in plain["weights"].items():
            torch.testing.assert_close(sp["weights"][key], tensor, rtol=1e-5, atol=1e-6)


def test_norm_weights_stay_identical_across_tensor_parallel_ranks(ranks):
    # each rank sees half the sequence; without the summed gradient the replicas would drift apart
    norms = [ranks[r]["sp"]["norms_after"] for r in (0, 1)]
    assert len(norms[0]) == ranks[0]["sp"]["marked"] > 0
    for a, b in zip(*norms):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_flag_is_honoured_and_a_critic_is_refused(tmp_path):
    base = ["--output-dir", str(tmp_path), "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--resource", '{"actor": [1, 2], "rollout": [1, 1]}']
    require_supported(parse_config(base))  # not "not supported yet"
    with pytest.raises(ConfigError, match="--sequence-parallel with --advantage-estimator ppo"):
        parse_config(base + ["--advantage-estimator", "ppo"])
