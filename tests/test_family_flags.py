"""The architecture flags of the model families beside qwen2 (GLM4, Nemotron, Qwen2-MoE): each project model flag
file (examples/launch/models) runs unchanged against a config of its model and builds the same model as the HF
config, a flag that disagrees with the model is named with both values, the family's features come together (and
apart with their own errors), and its flags are no longer refused."""

import importlib.util
from pathlib import Path

import pytest
from transformers import AutoConfig, Glm4Config, NemotronConfig, Qwen2MoeConfig, Qwen3MoeConfig

from relax.formats.model_arch import ModelArch, arch_for_run
from relax.config import ConfigError, parse_config
from launch_files import flag_run, model_args
from relax.config.support import require_supported, unsupported_flags

ROOT = Path(__file__).resolve().parents[1]

# GLM4-9B's config.json sizes (the flag file's model)
GLM4_9B = dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
               num_attention_heads=32, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
               partial_rotary_factor=0.5, attention_bias=True, tie_word_embeddings=False,
               max_position_embeddings=131072)
# the flag file scaled down to the tests' tiny shapes (relax.models.tiny.TinyArch, family glm4)
TINY_GLM4_ARGS = [
    "--swiglu", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--use-rotary-position-embeddings",
    "--disable-bias-linear", "--add-qkv-bias", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--rotary-base", "10000", "--vocab-size", "320", "--post-self-attn-layernorm", "--post-mlp-layernorm",
    "--rotary-interleaved", "--rotary-percent", "0.5", "--no-rope-fusion", "--untie-embeddings-and-output-weights",
]
TINY_GLM4 = dict(vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.5,
                 attention_bias=True, tie_word_embeddings=False, max_position_embeddings=512)

# Nemotron-Mini-4B-Instruct's config.json sizes (the flag file's model)
NEMOTRON_MINI_4B = dict(vocab_size=256000, hidden_size=3072, intermediate_size=9216, num_hidden_layers=32,
                        num_attention_heads=24, num_key_value_heads=8, head_dim=128, norm_eps=1e-5,
                        max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="relu2",
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
# relax.models.tiny's nemotron family as a config, and its flag file
TINY_NEMOTRON = dict(vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
TINY_NEMOTRON_ARGS = [
    "--squared-relu", "--apply-layernorm-1p", "--normalization", "LayerNorm", "--norm-epsilon", "1e-6",
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--position-embedding-type", "rope",
    "--rotary-percent", "0.5", "--rotary-base", "10000", "--max-position-embeddings", "512", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--vocab-size", "320",
]

# Qwen1.5-MoE-A2.7B's config.json sizes (the flag file's model)
QWEN15_MOE_A27B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                       num_attention_heads=16, num_key_value_heads=16, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       max_position_embeddings=8192, tie_word_embeddings=False, moe_intermediate_size=1408,
                       shared_expert_intermediate_size=5632, num_experts_per_tok=4, num_experts=60,
                       norm_topk_prob=False, decoder_sparse_step=1, use_sliding_window=False)
# relax.models.tiny's qwen2_moe family as a config, and its flag file
TINY_QWEN2_MOE = dict(vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
            tie_word_embeddings=False, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts_per_tok=2, num_experts=4, norm_topk_prob=False)
TINY_QWEN2_MOE_ARGS = [
    "--swiglu", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--position-embedding-type", "rope",
    "--disable-bias-linear", "--add-qkv-bias", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
    "--rotary-base", "10000", "--vocab-size", "320", "--untie-embeddings-and-output-weights",
    "--max-position-embeddings", "512", "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
    "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate",
]


def _config_dir(tmp_path, name, config_class, **sizes):
    config_class(**sizes).save_pretrained(tmp_path / name)  # the config is all the checks read
    return tmp_path / name


def _refused_naming(argv, needles):
    """The run `argv` is refused before it starts, the error naming each of `needles`; returns the error."""
    with pytest.raises(ConfigError) as exc:
        parse_config(argv)
    msg = str(exc.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


# ------------------------------------------------------------------------------ each family's flag file
def _glm4_hf(hf):
    assert (hf.hf_family, hf.rotary_percent, hf.rotary_interleaved, hf.kv_channels) == ("glm4", 0.5, True, 128)


def _nemotron_hf(hf):
    assert (hf.hf_family, hf.rotary_percent, hf.rotary_interleaved, hf.kv_channels, hf.num_query_groups) == (
        "nemotron", 0.5, False, 128, 8)
    assert (hf.normalization, hf.swiglu, hf.squared_relu, hf.layernorm_zero_centered_gamma, hf.norm_epsilon) == (
        "LayerNorm", False, True, True, 1e-5)


def _qwen2_moe_hf(hf):
    assert (hf.hf_family, hf.num_experts, hf.moe_router_topk, hf.moe_norm_topk_prob, hf.add_qkv_bias) == (
        "qwen2_moe", 60, 4, False, True)
    assert (hf.moe_shared_expert_intermediate_size, hf.moe_shared_expert_gate, hf.kv_channels) == (5632, True, 128)


# family: (its flag file, flags the file must hold, the HF config of its model, sizes, more run flags, the HF checks)
FLAG_FILES = {
    "glm4": ("glm4-9B.sh", {"--post-self-attn-layernorm", "--rotary-interleaved", "--rotary-percent"}, Glm4Config,
             GLM4_9B, ["--max-position-embeddings", "131072"], _glm4_hf),
    "nemotron": ("nemotron-mini-4B.sh", {"--squared-relu", "--apply-layernorm-1p", "--rotary-percent"},
                 NemotronConfig, NEMOTRON_MINI_4B, [], _nemotron_hf),
    "qwen2_moe": ("qwen1.5-moe-A2.7B.sh", {"--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate",
                                           "--add-qkv-bias"}, Qwen2MoeConfig, QWEN15_MOE_A27B, [], _qwen2_moe_hf),
}


@pytest.mark.parametrize("family", list(FLAG_FILES))
def test_the_flag_file_runs_unchanged_and_builds_the_hf_configs_model(family, prompt_file, tmp_path):
    script, holds, config_class, sizes, more, check_hf = FLAG_FILES[family]
    args = model_args(script)
    assert holds <= set(args)
    folder = _config_dir(tmp_path, script.removesuffix(".sh"), config_class, **sizes)
    config = parse_config(flag_run(folder, prompt_file, tmp_path, *args, "--seq-length", "4096", *more))
    assert unsupported_flags(config) == []
    require_supported(config)
    hf = ModelArch.from_hf_config(AutoConfig.from_pretrained(folder))
    check_hf(hf)
    assert arch_for_run(config) == hf
    assert ModelArch.from_flags(config) == hf  # the flags alone describe the same model
    assert ModelArch.from_flags(hf.to_flags()) == hf


# family: (its features' flags, a flag still refused: a feature no supported family has, or not built)
FEATURES = {
    "glm4": (("rotary_percent", "rotary_interleaved", "post_self_attn_layernorm", "post_mlp_layernorm"),
             "rotary_seq_len_interpolation_factor"),
    "nemotron": (("squared_relu", "layernorm_zero_centered_gamma"), "openai_gelu"),
    "qwen2_moe": (("moe_shared_expert_intermediate_size", "moe_shared_expert_gate"), "moe_shared_expert_overlap"),
}


@pytest.mark.parametrize("family", list(FEATURES))
def test_the_familys_flags_are_no_longer_refused(family):
    features, still_refused = FEATURES[family]
    spec = importlib.util.spec_from_file_location("count_refused_flags", ROOT / "scripts" / "count_refused_flags.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    megatron, relax = script.refused()
    refused = {dest for groups in (megatron, relax) for dests in groups.values() for dest in dests}
    assert not refused & set(features)
    assert still_refused in refused


# ------------------------------------------------------------------------------ GLM4
def test_glm4_flags_that_disagree_with_the_model_are_named_with_both_values(tiny_model, prompt_file, tmp_path):
    # the GLM4 flag file used with the tests' qwen2 model
    msg = _refused_naming(flag_run(tiny_model, prompt_file, tmp_path, *TINY_GLM4_ARGS),
                          ["--rotary-percent 0.5: the HF config gives 1.0 (partial_rotary_factor",
                           "--rotary-interleaved: the HF config's model is built without it (model_type glm4",
                           "--post-self-attn-layernorm: the HF config's model is built without it (model_type glm4",
                           "--post-mlp-layernorm: the HF config's model is built without it (model_type glm4"])
    assert "--hidden-size" not in msg  # the sizes agree
    # and the right family with another fraction rotated
    folder = _config_dir(tmp_path, "glm4", Glm4Config, **TINY_GLM4)
    config = parse_config(flag_run(folder, prompt_file, tmp_path, *TINY_GLM4_ARGS))
    assert arch_for_run(config) == ModelArch.from_hf_config(AutoConfig.from_pretrained(folder))
    wrong = [a if a != "0.5" else "0.25" for a in TINY_GLM4_ARGS]
    with pytest.raises(ConfigError, match=r"--rotary-percent 0.25: the HF config gives 0.5 \(partial_rotary_factor"):
        parse_config(flag_run(folder, prompt_file, tmp_path, *wrong))


def test_glm4_features_come_together():
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 320, "seq_length": 64,
            "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope", "add_bias_linear": False}
    glm4 = {"post_self_attn_layernorm": True, "post_mlp_layernorm": True, "rotary_interleaved": True,
            "rotary_percent": 0.5}
    arch = ModelArch.from_flags({**base, **glm4})
    assert arch.hf_family == "glm4" and arch.rotary_percent == 0.5 and not arch.add_qkv_bias
    for flags, needle in (
            ({"rotary_percent": 0.5}, "--rotary-percent 0.5: only GLM4 models rotate part of the head"),
            ({**glm4, "rotary_interleaved": False},
             "--post-self-attn-layernorm --post-mlp-layernorm without --rotary-interleaved"),
            ({**glm4, "qk_layernorm": True}, "with --qk-layernorm: the GLM4 features with another family's"),
            ({**glm4, "rotary_percent": 1.5}, "--rotary-percent 1.5: not a fraction of the head")):
        with pytest.raises(ValueError, match=needle):
            ModelArch.from_flags({**base, **flags})
    with pytest.raises(NotImplementedError, match="partial_rotary_factor 0.5 in a qwen2 model"):
        ModelArch.from_hf_config({**TINY_GLM4, "model_type": "qwen2"})


# ------------------------------------------------------------------------------ Nemotron
def test_nemotron_flags_that_disagree_with_the_model_are_named_with_both_values(tiny_model, prompt_file, tmp_path):
    # the Nemotron flag file used with the tests' qwen2 model
    msg = _refused_naming(flag_run(tiny_model, prompt_file, tmp_path, *TINY_NEMOTRON_ARGS),
                          ["--squared-relu: the HF config's model is built without it (hidden_act relu2",
                           "--apply-layernorm-1p: the HF config's model is built without it (model_type nemotron",
                           "--rotary-percent 0.5: the HF config gives 1.0 (partial_rotary_factor"])
    assert "--hidden-size" not in msg  # the sizes agree
    # the right family with another fraction rotated, or with a qwen2 flag file's MLP and norm
    folder = _config_dir(tmp_path, "nemotron", NemotronConfig, **TINY_NEMOTRON)
    config = parse_config(flag_run(folder, prompt_file, tmp_path, *TINY_NEMOTRON_ARGS))
    assert arch_for_run(config) == ModelArch.from_hf_config(AutoConfig.from_pretrained(folder))
    wrong = [a if a != "0.5" else "0.25" for a in TINY_NEMOTRON_ARGS]
    with pytest.raises(ConfigError, match=r"--rotary-percent 0.25: the HF config gives 0.5 \(partial_rotary_factor"):
        parse_config(flag_run(folder, prompt_file, tmp_path, *wrong))
    own = ("--squared-relu", "--apply-layernorm-1p", "--rotary-percent", "0.5", "--normalization", "LayerNorm")
    qwen2_style = [a for a in TINY_NEMOTRON_ARGS if a not in own]
    _refused_naming(flag_run(folder, prompt_file, tmp_path, *qwen2_style, "--swiglu", "--normalization", "RMSNorm"),
                    ["--swiglu: the HF config's model is built without it",
                     "--normalization RMSNorm: the HF config gives LayerNorm"])


def test_nemotron_features_come_together():
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 320, "seq_length": 64,
            "normalization": "LayerNorm", "position_embedding_type": "rope", "add_bias_linear": False}
    nemotron = {"squared_relu": True, "layernorm_zero_centered_gamma": True, "rotary_percent": 0.5}
    arch = ModelArch.from_flags({**base, **nemotron})
    assert (arch.hf_family, arch.rotary_percent, arch.ffn_hidden_size) == ("nemotron", 0.5, 4 * 64)
    for flags, needle in (
            ({**base, "squared_relu": True}, "--squared-relu without --apply-layernorm-1p: Nemotron models"),
            ({**base, **nemotron, "normalization": "RMSNorm"},
             r"without --normalization LayerNorm \(not RMSNorm\)"),
            ({**base, **nemotron, "swiglu": True}, "with --swiglu: the Nemotron features with another family's"),
            ({**base, **nemotron, "rotary_interleaved": True}, "with --rotary-interleaved: the Nemotron features"),
            ({**base, **nemotron, "rotary_percent": 1.5}, "--rotary-percent 1.5: not a fraction of the head"),
            ({**base, "swiglu": True, "normalization": "RMSNorm", "rotary_percent": 0.5},
             "--rotary-percent 0.5: only GLM4 models rotate part of the head .* and Nemotron models")):
        with pytest.raises(ValueError, match=needle):
            ModelArch.from_flags({**base, **flags})
    for change, needle in (({"attention_bias": True}, "nemotron with attention_bias"),
                           ({"hidden_act": "silu"}, "hidden_act 'silu' in a nemotron model")):
        with pytest.raises(NotImplementedError, match=needle):
            ModelArch.from_hf_config({**TINY_NEMOTRON, "model_type": "nemotron", **change})


# ------------------------------------------------------------------------------ Qwen2-MoE
def test_qwen2_moe_flags_that_disagree_with_the_model_are_named_with_both_values(prompt_file, tmp_path):
    folder = _config_dir(tmp_path, "qwen2moe", Qwen2MoeConfig, **TINY_QWEN2_MOE)
    config = parse_config(flag_run(folder, prompt_file, tmp_path, *TINY_QWEN2_MOE_ARGS))
    assert arch_for_run(config) == ModelArch.from_hf_config(AutoConfig.from_pretrained(folder))
    wrong = [a if a != "48" else "96" for a in TINY_QWEN2_MOE_ARGS]
    with pytest.raises(ConfigError, match=r"--moe-shared-expert-intermediate-size 96: the HF config gives 48 "
                                          r"\(shared_expert_intermediate_size"):
        parse_config(flag_run(folder, prompt_file, tmp_path, *wrong))
    # the Qwen2-MoE flag file used with a Qwen3-MoE model of the same sizes: no shared expert, no QKV biases,
    # top-k weights renormalised
    qwen3 = _config_dir(tmp_path, "qwen3moe", Qwen3MoeConfig, head_dim=16, norm_topk_prob=True,
                        **{k: v for k, v in TINY_QWEN2_MOE.items() if k not in ("shared_expert_intermediate_size",
                                                                      "norm_topk_prob")})
    msg = _refused_naming(flag_run(qwen3, prompt_file, tmp_path, *TINY_QWEN2_MOE_ARGS), [
        "--moe-shared-expert-intermediate-size 48: the HF config has none (shared_expert_intermediate_size",
        "--moe-shared-expert-gate: the HF config's model is built without it (model_type qwen2_moe",
        "--add-qkv-bias: the HF config's model is built without it",
        "--moe-router-pre-softmax: the HF config's model is built without it"])
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
        ModelArch.from_hf_config({**TINY_QWEN2_MOE, "model_type": "qwen2_moe", "mlp_only_layers": [1]})


def test_without_a_readable_hf_config_only_contradicting_moe_flags_are_refused(prompt_file, tmp_path):
    # a launch script's --dry-run on another machine: the model path does not exist here, so the flags may be part
    # of the model's description (the HF config gives the rest), but a shared expert in Qwen3-MoE is no model
    run = flag_run(tmp_path / "absent", prompt_file, tmp_path, "--num-experts", "4", "--moe-router-topk", "2")
    assert parse_config(run).num_experts == 4
    with pytest.raises(ConfigError, match="--moe-shared-expert-intermediate-size 48 with --qk-layernorm: Qwen3-MoE"):
        parse_config(run + ["--qk-layernorm", "--moe-shared-expert-intermediate-size", "48"])
