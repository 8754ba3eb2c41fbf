"""HF <-> Megatron weights at TP=1: logits equal the HF model's, export round-trips exactly."""

import pytest
import torch

from relax.backends.megatron.transformer_config import to_transformer_config
from relax.formats.model_arch import ModelArch
from relax.backends.megatron.hf_weights import (
    export_hf_weights,
    fuse_qkv,
    load_hf_checkpoint_dir,
    load_hf_weights,
    split_qkv,
)
from relax.backends.megatron.model import build_gpt_model
from relax.backends.megatron.testing import build_random_tiny_model

torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("megatron_process")  # tests/megatron_fixtures.py


def _load(path):
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(path))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return arch, hf


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_logits_match_hf_and_export_roundtrips(tmp_path, family):
    path = build_random_tiny_model(tmp_path / family, family, seed=1)
    arch, hf = _load(path)
    assert arch.hf_family == family
    assert arch.add_qkv_bias == (family == "qwen2")
    assert arch.qk_layernorm == (family == "qwen3")
    model = build_gpt_model(arch, to_transformer_config(arch)).eval()
    state = load_hf_checkpoint_dir(path)
    load_hf_weights(model, arch, state)

    ids = torch.randint(0, arch.hf_vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(17).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ours = model(ids, positions, None)
        ref = hf(ids).logits
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-5

    exported = dict(export_hf_weights(model, arch))
    assert set(exported) == set(state.keys())
    for name, tensor in exported.items():
        assert torch.equal(tensor, state[name]), name


def test_tied_embeddings(tmp_path):
    path = build_random_tiny_model(tmp_path / "tied", "llama", seed=2, tie_word_embeddings=True)
    arch, hf = _load(path)
    assert not arch.untie_embeddings_and_output_weights
    model = build_gpt_model(arch, to_transformer_config(arch)).eval()
    state = load_hf_checkpoint_dir(path)
    load_hf_weights(model, arch, state)
    ids = torch.randint(0, arch.hf_vocab_size, (1, 9))
    with torch.no_grad():
        diff = (model(ids, torch.arange(9).unsqueeze(0), None) - hf(ids).logits).abs().max()
    assert diff.item() < 1e-5
    exported = dict(export_hf_weights(model, arch))
    assert "lm_head.weight" not in exported
    assert all(torch.equal(exported[k], state[k]) for k in state.keys())


def test_padded_vocab(tmp_path):
    path = build_random_tiny_model(tmp_path / "pad", "qwen2", seed=3)
    arch, hf = _load(path)
    padded = arch.with_vocab_multiple(128)
    assert padded.vocab_size == 384 and padded.hf_vocab_size == 320
    model = build_gpt_model(padded, to_transformer_config(padded)).eval()
    state = load_hf_checkpoint_dir(path)
    load_hf_weights(model, padded, state)
    ids = torch.randint(0, 320, (1, 8))
    with torch.no_grad():
        ours = model(ids, torch.arange(8).unsqueeze(0), None)
    assert ours.shape[-1] == 384
    assert (ours[..., :320] - hf(ids).logits).abs().max().item() < 1e-5
    exported = dict(export_hf_weights(model, padded))
    assert exported["model.embed_tokens.weight"].shape[0] == 320
    assert all(torch.equal(exported[k], state[k]) for k in state.keys())


def test_strict_loading_reports_missing(tmp_path):
    path = build_random_tiny_model(tmp_path / "m", "llama", seed=4)
    arch, _ = _load(path)
    model = build_gpt_model(arch, to_transformer_config(arch))
    state = dict(load_hf_checkpoint_dir(path))
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        load_hf_weights(model, arch, state)
    state = dict(load_hf_checkpoint_dir(path))
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="not mapped"):
        load_hf_weights(model, arch, state)


def test_qkv_fusion_is_grouped_and_invertible():
    arch = ModelArch(
        num_layers=1, hidden_size=8, ffn_hidden_size=8, num_attention_heads=4,
        num_query_groups=2, kv_channels=2, vocab_size=16, max_position_embeddings=8,
    )
    q = torch.arange(8).float().repeat_interleave(1).reshape(8, 1)  # 4 heads x 2
    k = 100 + torch.arange(4).float().reshape(4, 1)
    v = 200 + torch.arange(4).float().reshape(4, 1)
    fused = fuse_qkv(arch, q, k, v).flatten().tolist()
    # group 0: q heads 0,1 then k0 then v0; group 1: q heads 2,3, k1, v1
    assert fused == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    back = split_qkv(arch, fuse_qkv(arch, q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_arch_from_dict_and_unsupported():
    cfg = {
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100,
        "max_position_embeddings": 64, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    }
    arch = ModelArch.from_hf_config(cfg, vocab_multiple=64)
    assert (arch.vocab_size, arch.hf_vocab_size, arch.rotary_base) == (128, 100, 500000.0)
    assert arch.kv_channels == 8 and arch.untie_embeddings_and_output_weights
    tcfg = to_transformer_config(arch, tp=2)
    assert tcfg.tensor_model_parallel_size == 2 and tcfg.gated_linear_unit
    with pytest.raises(NotImplementedError):
        ModelArch.from_hf_config({**cfg, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="divisible"):
        to_transformer_config(ModelArch.from_hf_config(cfg), tp=3)
