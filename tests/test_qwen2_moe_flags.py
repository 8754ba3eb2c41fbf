"""Qwen2-MoE's architecture flags: the project's Qwen1.5-MoE-A2.7B model flag file runs unchanged against a matching
qwen2_moe config and builds the same model as the HF config, a flag that disagrees is named with both values, and the
shared expert's flags come together with the MoE family they make."""

import importlib.util
import shlex
from pathlib import Path

import pytest
from transformers import AutoConfig, Qwen2MoeConfig, Qwen3MoeConfig

from relax.backends.megatron.arch import ModelArch, arch_for_run
from relax.config import ConfigError, parse_config
from relax.config.support import require_supported, unsupported_flags

ROOT = Path(__file__).resolve().parents[1]
SHARED_EXPERT_FLAGS = ("moe_shared_expert_intermediate_size", "moe_shared_expert_gate")

# Qwen1.5-MoE-A2.7B's config.json sizes (the flag file's model)
QWEN15_MOE_A27B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                       num_attention_heads=16, num_key_value_heads=16, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       max_position_embeddings=8192, tie_word_embeddings=False, moe_intermediate_size=1408,
                       shared_expert_intermediate_size=5632, num_experts_per_tok=4, num_experts=60,
                       norm_topk_prob=False, decoder_sparse_step=1, use_sliding_window=False)
# relax.models.tiny's qwen2_moe family as a config, and its flag file
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
            tie_word_embeddings=False, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts_per_tok=2, num_experts=4, norm_topk_prob=False)
TINY_ARGS = [
    "--swiglu", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--position-embedding-type", "rope",
    "--disable-bias-linear", "--add-qkv-bias", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--rotary-base", "10000", "--vocab-size", "320", "--untie-embeddings-and-output-weights",
    "--max-position-embeddings", "512", "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
    "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate",
]


def _model_args(name: str) -> list[str]:
    """MODEL_ARGS of examples/launch/models/<name>, as bash splits them."""
    text = (ROOT / "examples" / "launch" / "models" / name).read_text()
    body = text[text.index("MODEL_ARGS=(") + len("MODEL_ARGS=("):]
    return shlex.split(body[:body.index(")")], comments=True)


def _run(model, prompt_file, tmp_path, *flags):
    return ["--hf-checkpoint", str(model), "--prompt-data", prompt_file, "--rollout-batch-size", "2",
            "--num-rollout", "2", "--output-dir", str(tmp_path / "out"), *flags]


def _config_dir(tmp_path, name, config_class=Qwen2MoeConfig, **sizes):
    config_class(**sizes).save_pretrained(tmp_path / name)  # the config is all the checks read
    return tmp_path / name


def test_the_qwen15_moe_flag_file_runs_unchanged_and_builds_the_hf_configs_model(prompt_file, tmp_path):
    args = _model_args("qwen1.5-moe-A2.7B.sh")
    assert {"--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate", "--add-qkv-bias"} <= set(args)
    folder = _config_dir(tmp_path, "qwen1.5-moe", **QWEN15_MOE_A27B)
    config = parse_config(_run(folder, prompt_file, tmp_path, *args, "--seq-length", "4096"))
    assert unsupported_flags(config) == []
    require_supported(config)
    hf = ModelArch.from_hf_config(AutoConfig.from_pretrained(folder))
    assert (hf.hf_family, hf.num_experts, hf.moe_router_topk, hf.moe_norm_topk_prob, hf.add_qkv_bias) == (
        "qwen2_moe", 60, 4, False, True)
    assert (hf.moe_shared_expert_intermediate_size, hf.moe_shared_expert_gate, hf.kv_channels) == (5632, True, 128)
    assert arch_for_run(config) == hf
    assert ModelArch.from_flags(config) == hf  # the flags alone describe the same model
    assert ModelArch.from_flags(hf.to_flags()) == hf


def test_flags_that_disagree_with_the_model_are_named_with_both_values(prompt_file, tmp_path):
    folder = _config_dir(tmp_path, "qwen2moe", **TINY)
    config = parse_config(_run(folder, prompt_file, tmp_path, *TINY_ARGS))
    assert arch_for_run(config) == ModelArch.from_hf_config(AutoConfig.from_pretrained(folder))
    wrong = [a if a != "48" else "96" for a in TINY_ARGS]
    with pytest.raises(ConfigError, match=r"--moe-shared-expert-intermediate-size 96: the HF config gives 48 "
                                          r"\(shared_expert_intermediate_size"):
        parse_config(_run(folder, prompt_file, tmp_path, *wrong))
    # the Qwen2-MoE flag file used with a Qwen3-MoE model of the same sizes: no shared expert, no QKV biases,
    # top-k weights renormalised
    qwen3 = _config_dir(tmp_path, "qwen3moe", Qwen3MoeConfig, head_dim=16, norm_topk_prob=True,
                        **{k: v for k, v in TINY.items() if k not in ("shared_expert_intermediate_size",
                                                                      "norm_topk_prob")})
    with pytest.raises(ConfigError) as exc:
        parse_config(_run(qwen3, prompt_file, tmp_path, *TINY_ARGS))
    msg = str(exc.value)
    for needle in ("--moe-shared-expert-intermediate-size 48: the HF config has none (shared_expert_intermediate_size",
                   "--moe-shared-expert-gate: the HF config's model is built without it (model_type qwen2_moe",
                   "--add-qkv-bias: the HF config's model is built without it",
                   "--moe-router-pre-softmax: the HF config's model is built without it"):
        assert needle in msg, (needle, msg)
    assert "--hidden-size" not in msg and "--num-experts" not in msg  # the sizes agree


def test_the_shared_expert_flags_come_together_with_their_moe_family():
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 320, "seq_length": 64,
            "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope", "add_bias_linear": False,
            "num_experts": 4, "moe_ffn_hidden_size": 32}
    shared = {"moe_shared_expert_intermediate_size": 48, "moe_shared_expert_gate": True}
    arch = ModelArch.from_flags({**base, **shared})
    assert arch.hf_family == "qwen2_moe" and arch.moe_shared_expert_intermediate_size == 48
    assert ModelArch.from_flags({**base, "qk_layernorm": True}).hf_family == "qwen3_moe"
    dense = {k: v for k, v in base.items() if k not in ("num_experts", "moe_ffn_hidden_size")}
    for flags, needle in (
            (base, "--num-experts without --qk-layernorm is a Qwen2-MoE model, which has a gated shared expert: "
                   "--moe-shared-expert-intermediate-size --moe-shared-expert-gate is required"),
            ({**base, "moe_shared_expert_intermediate_size": 48},
             "Qwen2-MoE model, which has a gated shared expert: --moe-shared-expert-gate is required"),
            ({**base, **shared, "qk_layernorm": True},
             "--moe-shared-expert-intermediate-size 48 --moe-shared-expert-gate with --qk-layernorm: Qwen3-MoE models"),
            ({**dense, **shared}, "--moe-shared-expert-intermediate-size 48 --moe-shared-expert-gate without "
                                  "--num-experts")):
        with pytest.raises(ValueError, match=needle):
            ModelArch.from_flags(flags)
    with pytest.raises(NotImplementedError, match="qwen2_moe with dense layers mixed in"):
        ModelArch.from_hf_config({**TINY, "model_type": "qwen2_moe", "mlp_only_layers": [1]})


def test_the_shared_expert_flags_are_no_longer_refused():
    spec = importlib.util.spec_from_file_location("count_refused_flags", ROOT / "scripts" / "count_refused_flags.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    megatron, relax = script.refused()
    refused = {dest for groups in (megatron, relax) for dests in groups.values() for dest in dests}
    assert not refused & set(SHARED_EXPERT_FLAGS)
    assert "moe_shared_expert_overlap" in refused  # overlapping it with the dispatch is still not built


def test_without_a_readable_hf_config_only_contradicting_moe_flags_are_refused(prompt_file, tmp_path):
    # a launch script's --dry-run on another machine: the model path does not exist here, so the flags may be part
    # of the model's description (the HF config gives the rest), but a shared expert in Qwen3-MoE is no model
    run = _run(tmp_path / "absent", prompt_file, tmp_path, "--num-experts", "4", "--moe-router-topk", "2")
    assert parse_config(run).num_experts == 4
    with pytest.raises(ConfigError, match="--moe-shared-expert-intermediate-size 48 with --qk-layernorm: Qwen3-MoE"):
        parse_config(run + ["--qk-layernorm", "--moe-shared-expert-intermediate-size", "48"])
