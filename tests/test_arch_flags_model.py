"""The model built from architecture flags alone (no HF config to read) is a real Megatron model: given the same
weights it computes the same log-probs as the model built from the HF config, and it trains."""

import math

import pytest
import torch
from transformers import AutoConfig

from relax.formats.model_arch import ModelArch, arch_for_run
from relax.backends.megatron.hf_weights import load_hf_checkpoint_dir
from relax.backends.megatron.testing import build_random_tiny_model, toy_pg_loss, toy_samples
from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings

torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("megatron_process")  # tests/megatron_fixtures.py


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


def test_llama31_rope_scaling_flags_compute_hfs_rope_scaling(tmp_path):
    # --use-rope-scaling --rope-scaling-factor 8 is HF's rope_scaling of rope_type llama3 (Megatron fixes the other
    # llama3 parameters at Llama 3.1's: low/high frequency factors 1 and 4, 8192 original positions). With theta
    # 10000 and 16-dim heads the two lowest frequencies are scaled, so the logits tell scaled from unscaled RoPE.
    from transformers import AutoModelForCausalLM, LlamaConfig

    from relax.backends.megatron.transformer_config import to_transformer_config
    from relax.backends.megatron.hf_weights import load_hf_weights
    from relax.backends.megatron.model import build_gpt_model

    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                         rope_theta=10000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 8192})
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # random weights of the size build_random_tiny_model gives (HF's init is near zero)
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise)
    arch = ModelArch.from_hf_config(config)
    flags = {**arch.to_flags(), "hf_checkpoint": None}
    assert flags["use_rope_scaling"] and flags["rope_scaling_factor"] == 8.0 and arch_for_run(flags) == arch
    ids = torch.randint(0, 320, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        out = {}
        for name, a in (("scaled", arch), ("unscaled", ModelArch.from_flags({**flags, "use_rope_scaling": False}))):
            model = build_gpt_model(a, to_transformer_config(a)).eval()
            load_hf_weights(model, a, hf.state_dict())
            out[name] = model(ids, torch.arange(64).unsqueeze(0), None)
    diffs = {name: (logits - ref).abs().max().item() for name, logits in out.items()}
    assert diffs["scaled"] < 1e-4 and diffs["unscaled"] > 100 * diffs["scaled"], diffs
