"""Llama 3 RoPE scaling (rope_type llama3) with all four of the HF config's parameters: the trainer's log-probs are
transformers', and the embedded engine serves the same model. The tiny Llama-3.1-shaped model has a short original
context (64 positions) and low/high frequency factors 2 and 8, so that scaling changes most of its frequencies at
the lengths tested, and Megatron's fixed values (1, 4, 8192) would compute another function."""

import dataclasses
import json

import pytest
import torch
from family_checks import check_engine_serves_pushed_weights

from relax.backends.megatron.transformer_config import to_transformer_config
from relax.formats.model_arch import MEGATRON_LLAMA3_ROPE, ModelArch
from relax.backends.megatron.hf_weights import load_hf_checkpoint_dir, load_hf_weights
from relax.backends.megatron.model import build_gpt_model
from relax.backends.megatron.testing import (
    build_random_tiny_model,
    ensure_single_process,
    hf_response_logprobs,
    hf_trainer,
    toy_samples,
)

torch.set_num_threads(1)

# theta 10000, 16-dim heads: wavelengths 6.3, 19.9, 62.8, ... 19869 positions. With an original context of 64 and
# these factors the first is kept, the second smoothed and the other six divided by the factor.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 2.0,
          "high_freq_factor": 8.0, "original_max_position_embeddings": 64}


def build_tiny_llama3(path, rope=LLAMA3, seed=3):
    """The tests' tiny random Llama (byte tokenizer, every tensor random) with llama3 RoPE scaling."""
    path = build_random_tiny_model(path, "llama", seed=seed)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = dict(rope)
    config.pop("rope_scaling", None)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = build_tiny_llama3(tmp_path_factory.mktemp("llama3") / "llama3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, ModelArch.from_hf_config(AutoConfig.from_pretrained(path)), hf


def test_the_four_parameters_come_from_the_hf_config(llama3):
    path, arch, hf = llama3
    assert hf.config.rope_parameters["rope_type"] == "llama3"  # transformers builds the scaled model
    assert (arch.rope_scaling_factor, arch.rope_low_freq_factor, arch.rope_high_freq_factor,
            arch.rope_original_max_position_embeddings) == (8.0, 2.0, 8.0, 64)
    assert arch.llama3_rope_off_megatron() == {"low_freq_factor": (2.0, 1.0), "high_freq_factor": (8.0, 4.0),
                                               "original_max_position_embeddings": (64, 8192)}
    # the older config style (rope_scaling, rope_theta at the top), and a missing original context length, which
    # transformers takes as max_position_embeddings
    old = ModelArch.from_hf_config({**hf.config.to_dict(), "rope_parameters": None, "rope_theta": 10000.0,
                                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                                     "high_freq_factor": 8.0}})
    assert old.rope_original_max_position_embeddings == hf.config.max_position_embeddings == 512
    llama31 = {**LLAMA3, **MEGATRON_LLAMA3_ROPE}
    assert ModelArch.from_hf_config({**hf.config.to_dict(), "rope_parameters": llama31}).llama3_rope_off_megatron() \
        == {}


def _megatron_logits(arch, path, ids):
    model = build_gpt_model(arch, to_transformer_config(arch)).eval()
    load_hf_weights(model, arch, load_hf_checkpoint_dir(path))
    with torch.no_grad():
        return model, model(ids, torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1), None)


def test_megatron_logits_equal_transformers_and_differ_without_the_configs_parameters(llama3):
    ensure_single_process()
    path, arch, hf = llama3
    ids = torch.randint(0, arch.hf_vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    _, ours = _megatron_logits(arch, path, ids)
    assert (ours - ref).abs().max().item() < 1e-4
    # the same model with Megatron's fixed llama3 parameters, and without scaling: other functions
    fixed = dataclasses.replace(arch, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                                rope_original_max_position_embeddings=8192)
    unscaled = dataclasses.replace(fixed, rope_scaling_factor=None)
    for other in (fixed, unscaled):
        _, logits = _megatron_logits(other, path, ids)
        assert (logits - ref).abs().max().item() > 100 * max((ours - ref).abs().max().item(), 1e-6)


def test_trainer_logprobs_equal_transformers(llama3):
    ensure_single_process()
    path, arch, hf = llama3
    samples = toy_samples(4, seed=5, vocab=arch.hf_vocab_size, min_len=20, max_len=60)
    trainer = hf_trainer(path, lr=1e-3, micro_batch_size=2, seed=11)
    got = trainer.compute_logprobs(samples)
    with torch.no_grad():
        expected = hf_response_logprobs(hf, samples)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_embedded_engine_serves_the_scaled_model(llama3):
    # a weight push: Megatron's model after an update (here: noise), exported and copied into the engine's HF model,
    # which reads the four llama3 parameters from the same config.json
    ensure_single_process()
    path, arch, hf = llama3
    ids = torch.randint(0, arch.hf_vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    model, _ = _megatron_logits(arch, path, ids)
    check_engine_serves_pushed_weights(model, arch, path, hf, "LlamaForCausalLM")
