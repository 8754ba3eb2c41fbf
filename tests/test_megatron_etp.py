"""Expert tensor parallelism (--expert-tensor-parallel-size) on a tiny Qwen3-MoE model: two tensor-parallel
ranks whose experts are split by tensor parallelism too (ETP 2), or held whole on each rank while expert
parallelism splits them (ETP 1, EP 2), give the single rank's log-probs, losses and updated weights, and export
bit-identical full weights."""

import pytest
import torch
from transformers import AutoConfig

from relax.formats.model_arch import ModelArch
from relax.backends.megatron.hf_weights import load_hf_checkpoint_dir
from relax.backends.megatron.testing import (build_random_tiny_moe_model, ensure_single_process, run_ranks,
                                             toy_pg_loss, toy_samples)
from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings

torch.set_num_threads(1)

STEPS = 2
BASE = dict(lr=1e-3, micro_batch_size=2, seed=3)


def _arch(path):
    return ModelArch.from_hf_config(AutoConfig.from_pretrained(path))


def _worker(rank, world, path, samples, layout):
    trainer = MegatronTrainer(_arch(path), TrainerSettings(**layout, **BASE))
    trainer.load_hf(path)
    exported = dict(trainer.export_hf_weights())
    per = len(samples) // trainer.layout.dp
    mine = samples[trainer.layout.dp_rank * per:(trainer.layout.dp_rank + 1) * per]
    return {"export": exported, "dp_rank": trainer.layout.dp_rank, "per": per,
            "logprobs": trainer.compute_logprobs(mine),
            "metrics": [trainer.train_step(mine, toy_pg_loss) for _ in range(STEPS)],
            "weights": dict(trainer.export_hf_weights())}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_random_tiny_moe_model(tmp_path_factory.mktemp("etp") / "qwen3moe", seed=4)


@pytest.fixture(scope="module")
def single_rank(moe_dir):
    samples = toy_samples(4, seed=5)
    ensure_single_process()
    trainer = MegatronTrainer(_arch(moe_dir), TrainerSettings(**BASE))
    trainer.load_hf(moe_dir)
    logprobs = trainer.compute_logprobs(samples)
    metrics = [trainer.train_step(samples, toy_pg_loss) for _ in range(STEPS)]
    return samples, logprobs, metrics, dict(trainer.export_hf_weights())


@pytest.mark.parametrize("layout", [dict(tp=2, etp=2, sequence_parallel=True), dict(tp=2, etp=1, ep=2, sequence_parallel=True)], ids=["tp2-etp2", "tp2-etp1-ep2"])
def test_expert_tensor_parallel_matches_single_rank(moe_dir, single_rank, layout):
    samples, ref_logprobs, ref_metrics, ref_weights = single_rank
    ranks = run_ranks(_worker, 2, str(moe_dir), samples, layout, timeout=300)
    state = load_hf_checkpoint_dir(moe_dir)
    for out in ranks:
        assert set(out["export"]) == set(state)
        assert all(torch.equal(out["export"][k], state[k]) for k in state)
        first = out["dp_rank"] * out["per"]
        mine = ref_logprobs[first:first + out["per"]]
        assert max((a - b).abs().max().item() for a, b in zip(out["logprobs"], mine)) < 1e-5
        for got, want in zip(out["metrics"], ref_metrics):
            for key in ("loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        worst = max((out["weights"][k] - ref_weights[k]).abs().max().item() for k in ref_weights)
        assert worst < 0.1 * BASE["lr"], worst


def test_expert_layouts_checked_before_ray(tmp_path, tiny_model):
    from relax.config import ConfigError, parse_config

    moe = build_random_tiny_moe_model(tmp_path / "moe", seed=4)
    base = ["--hf-checkpoint", str(moe), "--output-dir", str(tmp_path / "run"),
            "--resource", '{"actor": [1, 2], "rollout": [1, 1]}']
    with pytest.raises(ConfigError, match="needs --sequence-parallel"):
        parse_config(base + ["--tensor-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size 2 with --tensor-model-parallel-size 1"):
        parse_config(base + ["--expert-tensor-parallel-size", "2"])
    with pytest.raises(ConfigError, match="the model is dense"):
        parse_config(["--hf-checkpoint", tiny_model, "--output-dir", str(tmp_path / "dense"),
                      "--resource", '{"actor": [1, 2], "rollout": [1, 1]}', "--tensor-model-parallel-size", "2",
                      "--expert-tensor-parallel-size", "2"])
    config = parse_config(base + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--expert-tensor-parallel-size", "2"])
    assert config.expert_tensor_parallel_size == 2
