"""The model built from architecture flags alone (no HF config to read) is a real Megatron model: given the same
weights it computes the same log-probs as the model built from the HF config, and it trains."""

import math

import pytest
import torch
from transformers import AutoConfig

from relax.backends.megatron.arch import ModelArch, arch_for_run
from relax.backends.megatron.hf_weights import load_hf_checkpoint_dir
from relax.backends.megatron.testing import build_random_tiny_model, ensure_single_process, toy_pg_loss, toy_samples
from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    ensure_single_process()


def _inputs():
    return [{"tokens": s["tokens"], "response_length": s["response_length"]} for s in toy_samples(4, seed=1, vocab=300)]


def test_flags_model_with_hf_weights_matches_the_hf_model_and_trains(tmp_path):
    path = build_random_tiny_model(tmp_path / "qwen3", "qwen3", seed=5)
    hf_arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(path))
    # a run's flags without --hf-checkpoint: the Qwen3 model file, and nothing to read the shape from
    flags = {**hf_arch.to_flags(), "hf_checkpoint": None, "tensor_model_parallel_size": 1}
    arch = arch_for_run(flags)
    assert arch == hf_arch and arch.hf_family == "qwen3"
    settings = TrainerSettings(lr=1e-3, micro_batch_size=2, seed=7)
    weights = load_hf_checkpoint_dir(path)

    from_hf = MegatronTrainer(hf_arch, settings)
    from_hf.load_hf(path)
    expected = from_hf.compute_logprobs(_inputs())
    del from_hf

    from_flags = MegatronTrainer(arch, settings)
    from_flags.load_hf_state_dict(weights)
    got = from_flags.compute_logprobs(_inputs())
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
    samples = toy_samples(4, seed=2, vocab=300)
    metrics = from_flags.train_step(samples, toy_pg_loss)
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
