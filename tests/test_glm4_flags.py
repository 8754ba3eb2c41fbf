"""GLM4's architecture flags: the project's GLM4-9B model flag file runs unchanged against a GLM4 config, builds
the same model as the HF config, a flag that disagrees is named with both values, and GLM4's features come
together."""

import importlib.util
import shlex
from pathlib import Path

import pytest
from transformers import AutoConfig, Glm4Config

from relax.backends.megatron.arch import ModelArch, arch_for_run
from relax.config import ConfigError, parse_config
from relax.config.support import require_supported, unsupported_flags

ROOT = Path(__file__).resolve().parents[1]
GLM4_FEATURES = ("rotary_percent", "rotary_interleaved", "post_self_attn_layernorm", "post_mlp_layernorm")

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


def _model_args(name: str) -> list[str]:
    """MODEL_ARGS of examples/launch/models/<name>.sh, as bash splits them."""
    text = (ROOT / "examples" / "launch" / "models" / name).read_text()
    body = text[text.index("MODEL_ARGS=(") + len("MODEL_ARGS=("):]
    return shlex.split(body[:body.index(")")], comments=True)


def _run(model, prompt_file, tmp_path, *flags):
    return ["--hf-checkpoint", str(model), "--prompt-data", prompt_file, "--rollout-batch-size", "2",
            "--num-rollout", "2", "--output-dir", str(tmp_path / "out"), *flags]


def _config_dir(tmp_path, name, **sizes):
    Glm4Config(**sizes).save_pretrained(tmp_path / name)  # the config is all the checks read
    return tmp_path / name


def test_the_glm4_9b_flag_file_runs_unchanged_and_builds_the_hf_configs_model(prompt_file, tmp_path):
    args = _model_args("glm4-9B.sh")
    assert {"--post-self-attn-layernorm", "--rotary-interleaved", "--rotary-percent"} <= set(args)
    folder = _config_dir(tmp_path, "glm4-9b", **GLM4_9B)
    config = parse_config(_run(folder, prompt_file, tmp_path, *args, "--seq-length", "4096",
                               "--max-position-embeddings", "131072"))
    assert unsupported_flags(config) == []
    require_supported(config)
    hf = ModelArch.from_hf_config(AutoConfig.from_pretrained(folder))
    assert (hf.hf_family, hf.rotary_percent, hf.rotary_interleaved, hf.kv_channels) == ("glm4", 0.5, True, 128)
    assert arch_for_run(config) == hf
    assert ModelArch.from_flags(config) == hf  # the flags alone describe the same model
    assert ModelArch.from_flags(hf.to_flags()) == hf


def test_flags_that_disagree_with_the_model_are_named_with_both_values(tiny_model, prompt_file, tmp_path):
    # the GLM4 flag file used with the tests' qwen2 model
    with pytest.raises(ConfigError) as exc:
        parse_config(_run(tiny_model, prompt_file, tmp_path, *TINY_GLM4_ARGS))
    msg = str(exc.value)
    for needle in ("--rotary-percent 0.5: the HF config gives 1.0 (partial_rotary_factor",
                   "--rotary-interleaved: the HF config's model is built without it (model_type glm4",
                   "--post-self-attn-layernorm: the HF config's model is built without it (model_type glm4",
                   "--post-mlp-layernorm: the HF config's model is built without it (model_type glm4"):
        assert needle in msg, (needle, msg)
    assert "--hidden-size" not in msg  # the sizes agree
    # and the right family with another fraction rotated
    folder = _config_dir(tmp_path, "glm4", **TINY_GLM4)
    config = parse_config(_run(folder, prompt_file, tmp_path, *TINY_GLM4_ARGS))
    assert arch_for_run(config) == ModelArch.from_hf_config(AutoConfig.from_pretrained(folder))
    wrong = [a if a != "0.5" else "0.25" for a in TINY_GLM4_ARGS]
    with pytest.raises(ConfigError, match=r"--rotary-percent 0.25: the HF config gives 0.5 \(partial_rotary_factor"):
        parse_config(_run(folder, prompt_file, tmp_path, *wrong))


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


def test_the_glm4_flags_are_no_longer_refused():
    spec = importlib.util.spec_from_file_location("count_refused_flags", ROOT / "scripts" / "count_refused_flags.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    megatron, relax = script.refused()
    refused = {dest for groups in (megatron, relax) for dests in groups.values() for dest in dests}
    assert not refused & set(GLM4_FEATURES)
    assert "rotary_seq_len_interpolation_factor" in refused  # still a feature no supported family has
