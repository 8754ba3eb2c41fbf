"""Megatron's architecture flags: checked against --hf-checkpoint before Ray, accepted when they agree, and
`ModelArch.from_flags` builds the same model as `ModelArch.from_hf_config` (dense and MoE shapes)."""

import pytest
from transformers import AutoConfig, LlamaConfig, Qwen3MoeConfig

from relax.formats.model_arch import ARCH_FLAGS, ModelArch, arch_for_run
from relax.config import ConfigError, parse_config
from relax.config.explain import write_resolved_config
from relax.config.rules_arch import ARCH_FLAG_HELP
from relax.config.support import IMPLEMENTED, require_supported, unsupported_flags
from relax.config.support_training import ARCH_FEATURES

# A model flag file of the tests' tiny model (qwen2-shaped, relax.models.tiny.TinyArch), written as launch
# scripts write them.
TINY_MODEL_ARGS = [
    "--swiglu", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--add-qkv-bias", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "10000", "--vocab-size", "320", "--kv-channels", "16",
    "--untie-embeddings-and-output-weights", "--max-position-embeddings", "512",
]

# Qwen3-MoE of the same kind as relax.backends.megatron.testing.build_random_tiny_moe_model.
MOE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
           norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False, rope_theta=1000000.0,
           rms_norm_eps=1e-6)
MOE_MODEL_ARGS = [
    "--swiglu", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--qk-layernorm",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--normalization", "RMSNorm", "--norm-epsilon",
    "1e-6", "--rotary-base", "1000000", "--rotary-percent", "1.0", "--vocab-size", "320",
    "--untie-embeddings-and-output-weights", "--max-position-embeddings", "256", "--num-experts", "4",
    "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2", "--moe-layer-freq", "[1]*2",
    "--moe-router-score-function", "softmax",
]


def _run(model, prompt_file, tmp_path, *flags):
    return ["--hf-checkpoint", str(model), "--prompt-data", prompt_file, "--rollout-batch-size", "2",
            "--num-rollout", "2", "--output-dir", str(tmp_path / "out"), *flags]


@pytest.fixture
def moe_model(tmp_path):
    folder = tmp_path / "moe"
    Qwen3MoeConfig(**MOE).save_pretrained(folder)  # the config is all the checks read
    return folder


def test_a_wrong_model_file_fails_before_ray_naming_each_flag_and_both_values(tiny_model, prompt_file, tmp_path):
    # a Qwen3-0.6B-like flag file used with the tiny qwen2 model
    wrong = ["--num-layers", "28", "--hidden-size", "1024", "--qk-layernorm", "--group-query-attention",
             "--num-query-groups", "8", "--rotary-base", "1000000", "--vocab-size", "151936"]
    with pytest.raises(ConfigError) as exc:
        parse_config(_run(tiny_model, prompt_file, tmp_path, *wrong))
    msg = str(exc.value)
    for needle in ("--num-layers 28: the HF config gives 2", "--hidden-size 1024: the HF config gives 64",
                   "--qk-layernorm: the HF config's model is built without it",
                   "--num-query-groups 8: the HF config gives 2 key/value heads",
                   "--rotary-base 1000000: the HF config gives 10000", "--vocab-size 151936: the HF config gives 320",
                   tiny_model, "model flag file"):
        assert needle in msg, (needle, msg)
    assert "--swiglu" not in msg  # only the flags that disagree are named


def test_query_groups_are_read_as_megatron_reads_them(tiny_model, prompt_file, tmp_path):
    # without --group-query-attention Megatron ignores --num-query-groups: every head has its own key/value
    with pytest.raises(ConfigError, match="--num-query-groups 2 without --group-query-attention"):
        parse_config(_run(tiny_model, prompt_file, tmp_path, "--num-query-groups", "2"))
    parse_config(_run(tiny_model, prompt_file, tmp_path, "--group-query-attention", "--num-query-groups", "2"))


def test_a_moe_file_on_a_dense_model_and_a_feature_the_model_lacks_are_named(tiny_model, prompt_file, tmp_path):
    with pytest.raises(ConfigError) as exc:
        parse_config(_run(tiny_model, prompt_file, tmp_path, "--num-experts", "4", "--moe-router-topk", "2",
                          "--apply-layernorm-1p", "--rotary-interleaved"))
    msg = str(exc.value)
    for needle in ("--num-experts 4: the HF config has none (a dense model)",
                   "--apply-layernorm-1p: the HF config's model is built without it",
                   "--rotary-interleaved: the HF config's model is built without it"):
        assert needle in msg, (needle, msg)


def test_agreeing_flags_are_accepted_by_the_support_check(tiny_model, prompt_file, tmp_path):
    config = parse_config(_run(tiny_model, prompt_file, tmp_path, *TINY_MODEL_ARGS, "--seq-length", "256"))
    assert unsupported_flags(config) == []
    require_supported(config)
    assert arch_for_run(config) == ModelArch.from_hf_config(AutoConfig.from_pretrained(tiny_model))


def test_moe_flags_that_agree_are_accepted_and_build_the_same_model(moe_model, prompt_file, tmp_path):
    config = parse_config(_run(moe_model, prompt_file, tmp_path, *MOE_MODEL_ARGS))
    assert unsupported_flags(config) == []
    hf = ModelArch.from_hf_config(AutoConfig.from_pretrained(moe_model))
    assert hf.is_moe and ModelArch.from_flags(config) == hf
    with pytest.raises(ConfigError, match="--moe-router-topk 8: the HF config gives 2") as exc:
        parse_config(_run(moe_model, prompt_file, tmp_path, "--moe-router-topk", "8",
                          "--moe-shared-expert-intermediate-size", "64"))
    assert ("--moe-shared-expert-intermediate-size 64: the HF config has none (shared_expert_intermediate_size: "
            "model_type qwen2_moe has a shared expert") in str(exc.value)


def test_from_flags_equals_from_hf_config_for_the_same_shape(tiny_model, prompt_file, tmp_path):
    # dense, from the parsed flag file (the flags are read as the parser types them)
    config = parse_config(_run(tiny_model, prompt_file, tmp_path, *TINY_MODEL_ARGS))
    assert ModelArch.from_flags(config) == ModelArch.from_hf_config(AutoConfig.from_pretrained(tiny_model))
    # and every supported family stated back as flags: dense, MoE, Llama-3.1 RoPE scaling with tied embeddings
    llama = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16384,
                        rope_theta=500000.0, tie_word_embeddings=True,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    for hf_config in (AutoConfig.from_pretrained(tiny_model), Qwen3MoeConfig(**MOE), llama):
        arch = ModelArch.from_hf_config(hf_config)
        assert ModelArch.from_flags(arch.to_flags()) == arch, arch.hf_family
        assert set(arch.to_flags()) == set(ARCH_FLAGS)


def test_from_flags_fills_megatron_defaults_and_names_what_it_cannot_build():
    arch = ModelArch.from_flags({"num_layers": 2, "hidden_size": 96, "num_attention_heads": 4, "vocab_size": 300,
                                 "seq_length": 128, "swiglu": True, "normalization": "RMSNorm",
                                 "position_embedding_type": "rope", "add_bias_linear": False,
                                 "num_query_groups": 1})  # ignored without --group-query-attention
    assert (arch.ffn_hidden_size, arch.kv_channels, arch.num_query_groups) == (256, 24, 4)
    assert (arch.max_position_embeddings, arch.norm_epsilon, arch.hf_family) == (128, 1e-5, "llama")
    with pytest.raises(ValueError) as exc:
        ModelArch.from_flags({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 320,
                              "max_position_embeddings": 64, "normalization": "LayerNorm", "rotary_interleaved": True})
    for needle in ("--swiglu is required", "--normalization LayerNorm", "--disable-bias-linear is required",
                   "--rotary-interleaved without --post-self-attn-layernorm --post-mlp-layernorm",
                   "--position-embedding-type rope"):
        assert needle in str(exc.value), needle


def test_without_an_hf_checkpoint_the_run_is_refused_naming_what_is_missing(prompt_file, tmp_path):
    base = ["--prompt-data", prompt_file, "--rollout-batch-size", "2", "--num-rollout", "2",
            "--output-dir", str(tmp_path / "out")]
    with pytest.raises(ConfigError, match="a run also needs --hf-checkpoint: the rollout engines and the prompt "
                                          "tokenizer load the model folder"):
        parse_config(base + TINY_MODEL_ARGS)
    with pytest.raises(ConfigError, match="cannot build the model from the architecture flags: --hidden-size is "
                                          "required"):
        parse_config(base + ["--num-layers", "2"])


def test_embedded_default_is_checked_against_the_model_it_builds(tmp_path):
    out = ["--output-dir", str(tmp_path / "out")]
    parse_config(out + TINY_MODEL_ARGS)  # the embedded model is the tiny qwen2 shape
    with pytest.raises(ConfigError, match="the embedded default model .*--num-layers 3: the HF config gives 2"):
        parse_config(out + ["--num-layers", "3"])


def test_flags_at_their_default_and_a_resolved_config_are_not_compared(tiny_model, prompt_file, tmp_path):
    # Megatron's defaults (LayerNorm, learned positions, 1e-5) restated by a resolved config are not choices
    config = parse_config(_run(tiny_model, prompt_file, tmp_path, *TINY_MODEL_ARGS, "--dry-run"))
    path = write_resolved_config(config, tmp_path / "resolved.yaml")
    again = parse_config(["--custom-config-path", str(path)])
    assert again["num_layers"] == 2 and again["normalization"] == "RMSNorm"
    parse_config(_run(tiny_model, prompt_file, tmp_path, "--position-embedding-type", "learned_absolute"))


def test_vocabulary_padding_follows_megatron(tiny_model, prompt_file, tmp_path):
    config = parse_config(_run(tiny_model, prompt_file, tmp_path, "--make-vocab-size-divisible-by", "256"))
    arch = arch_for_run(config)
    assert (arch.vocab_size, arch.hf_vocab_size) == (512, 320)  # 128, the default, is not a request
    assert arch_for_run(parse_config(_run(tiny_model, prompt_file, tmp_path, "--padded-vocab-size", "400"))
                        ).vocab_size == 400
    with pytest.raises(ConfigError, match="--padded-vocab-size 300: smaller than the HF config's vocab_size 320"):
        parse_config(_run(tiny_model, prompt_file, tmp_path, "--padded-vocab-size", "300"))
    with pytest.raises(ConfigError, match="--seq-length 4096: longer than the HF config's max_position_embeddings"):
        parse_config(_run(tiny_model, prompt_file, tmp_path, "--seq-length", "4096"))


def test_every_honoured_architecture_flag_is_a_parser_flag_with_help():
    from relax.config.parser import build_parser

    parser, _ = build_parser()
    dests = {a.dest for a in parser._actions}
    relax_own = {"post_self_attn_layernorm", "post_mlp_layernorm"}  # GLM4's: help in relax.config.flags.misc
    assert set(ARCH_FLAG_HELP) == ARCH_FEATURES - relax_own and ARCH_FEATURES <= dests and ARCH_FEATURES <= IMPLEMENTED
    assert set(ARCH_FLAGS) - ARCH_FEATURES == {  # features no supported model has: refused when set
        "openai_gelu", "quick_geglu", "qk_l2_norm",
        "apply_residual_connection_post_layernorm", "attention_output_gate", "multi_latent_attention",
        "rotary_seq_len_interpolation_factor", "moe_router_score_function",
        "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
        "moe_router_enable_expert_bias"}


def test_features_no_supported_model_has_stay_refused_when_the_model_cannot_be_read(prompt_file, tmp_path):
    # a launch script's --dry-run on another machine: the model path does not exist here
    run = ["--hf-checkpoint", str(tmp_path / "absent"), "--prompt-data", prompt_file, "--rollout-batch-size", "2",
           "--num-rollout", "2", "--output-dir", str(tmp_path / "out"), *TINY_MODEL_ARGS]
    config = parse_config(run + ["--position-embedding-type", "mrope", "--qk-l2-norm"])
    assert unsupported_flags(config) == ["--position-embedding-type mrope", "--qk-l2-norm"]
    # GLM4's features are built, but only together: a qwen2 flag file with partial interleaved RoPE is no model
    with pytest.raises(ConfigError, match="--rotary-interleaved without --post-self-attn-layernorm "
                                          "--post-mlp-layernorm: GLM4 models"):
        parse_config(run + ["--rotary-interleaved", "--rotary-percent", "0.5"])


def test_a_model_relax_cannot_build_or_read_is_named_when_flags_are_given(prompt_file, tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=4).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ConfigError, match=r"--hf-checkpoint .*gpt2: model_type 'gpt2' is not supported, so the "
                                          "architecture flags cannot describe it"):
        parse_config(_run(tmp_path / "gpt2", prompt_file, tmp_path, "--num-layers", "2"))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="transformers cannot read its config.json"):
        parse_config(_run(tmp_path / "odd", prompt_file, tmp_path, "--num-layers", "2"))
    parse_config(_run(tmp_path / "odd", prompt_file, tmp_path))  # without architecture flags: not read here
