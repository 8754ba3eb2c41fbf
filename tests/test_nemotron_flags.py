"""Nemotron's architecture flags: the project's Nemotron-Mini-4B model flag file runs unchanged against a matching
nemotron config and builds the same model as the HF config, a flag that disagrees is named with both values, and
Nemotron's features come together."""

import importlib.util
import shlex
from pathlib import Path

import pytest
from transformers import AutoConfig, NemotronConfig

from relax.backends.megatron.arch import ModelArch, arch_for_run
from relax.config import ConfigError, parse_config
from relax.config.support import require_supported, unsupported_flags

ROOT = Path(__file__).resolve().parents[1]
NEMOTRON_FEATURES = ("squared_relu", "layernorm_zero_centered_gamma")

# Nemotron-Mini-4B-Instruct's config.json sizes (the flag file's model)
NEMOTRON_MINI_4B = dict(vocab_size=256000, hidden_size=3072, intermediate_size=9216, num_hidden_layers=32,
                        num_attention_heads=24, num_key_value_heads=8, head_dim=128, norm_eps=1e-5,
                        max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="relu2",
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
# relax.models.tiny's nemotron family as a config, and its flag file
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
TINY_ARGS = [
    "--squared-relu", "--apply-layernorm-1p", "--normalization", "LayerNorm", "--norm-epsilon", "1e-6",
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--position-embedding-type", "rope",
    "--rotary-percent", "0.5", "--rotary-base", "10000", "--max-position-embeddings", "512", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--vocab-size", "320",
]


def _model_args(name: str) -> list[str]:
    """MODEL_ARGS of examples/launch/models/<name>, as bash splits them."""
    text = (ROOT / "examples" / "launch" / "models" / name).read_text()
    body = text[text.index("MODEL_ARGS=(") + len("MODEL_ARGS=("):]
    return shlex.split(body[:body.index(")")], comments=True)


def _run(model, prompt_file, tmp_path, *flags):
    return ["--hf-checkpoint", str(model), "--prompt-data", prompt_file, "--rollout-batch-size", "2",
            "--num-rollout", "2", "--output-dir", str(tmp_path / "out"), *flags]


def _config_dir(tmp_path, name, **sizes):
    NemotronConfig(**sizes).save_pretrained(tmp_path / name)  # the config is all the checks read
    return tmp_path / name


def test_the_nemotron_mini_flag_file_runs_unchanged_and_builds_the_hf_configs_model(prompt_file, tmp_path):
    args = _model_args("nemotron-mini-4B.sh")
    assert {"--squared-relu", "--apply-layernorm-1p", "--rotary-percent"} <= set(args)
    folder = _config_dir(tmp_path, "nemotron-mini", **NEMOTRON_MINI_4B)
    config = parse_config(_run(folder, prompt_file, tmp_path, *args, "--seq-length", "4096"))
    assert unsupported_flags(config) == []
    require_supported(config)
    hf = ModelArch.from_hf_config(AutoConfig.from_pretrained(folder))
    assert (hf.hf_family, hf.rotary_percent, hf.rotary_interleaved, hf.kv_channels, hf.num_query_groups) == (
        "nemotron", 0.5, False, 128, 8)
    assert (hf.normalization, hf.swiglu, hf.squared_relu, hf.layernorm_zero_centered_gamma, hf.norm_epsilon) == (
        "LayerNorm", False, True, True, 1e-5)
    assert arch_for_run(config) == hf
    assert ModelArch.from_flags(config) == hf  # the flags alone describe the same model
    assert ModelArch.from_flags(hf.to_flags()) == hf


def test_flags_that_disagree_with_the_model_are_named_with_both_values(tiny_model, prompt_file, tmp_path):
    # the Nemotron flag file used with the tests' qwen2 model
    with pytest.raises(ConfigError) as exc:
        parse_config(_run(tiny_model, prompt_file, tmp_path, *TINY_ARGS))
    msg = str(exc.value)
    for needle in ("--squared-relu: the HF config's model is built without it (hidden_act relu2",
                   "--apply-layernorm-1p: the HF config's model is built without it (model_type nemotron",
                   "--rotary-percent 0.5: the HF config gives 1.0 (partial_rotary_factor"):
        assert needle in msg, (needle, msg)
    assert "--hidden-size" not in msg  # the sizes agree
    # the right family with another fraction rotated, or with a qwen2 flag file's MLP and norm
    folder = _config_dir(tmp_path, "nemotron", **TINY)
    config = parse_config(_run(folder, prompt_file, tmp_path, *TINY_ARGS))
    assert arch_for_run(config) == ModelArch.from_hf_config(AutoConfig.from_pretrained(folder))
    wrong = [a if a != "0.5" else "0.25" for a in TINY_ARGS]
    with pytest.raises(ConfigError, match=r"--rotary-percent 0.25: the HF config gives 0.5 \(partial_rotary_factor"):
        parse_config(_run(folder, prompt_file, tmp_path, *wrong))
    qwen2_style = [a for a in TINY_ARGS if a not in ("--squared-relu", "--apply-layernorm-1p", "--rotary-percent",
                                                     "0.5", "--normalization", "LayerNorm")]
    with pytest.raises(ConfigError) as exc:
        parse_config(_run(folder, prompt_file, tmp_path, *qwen2_style, "--swiglu", "--normalization", "RMSNorm"))
    msg = str(exc.value)
    for needle in ("--swiglu: the HF config's model is built without it",
                   "--normalization RMSNorm: the HF config gives LayerNorm"):
        assert needle in msg, (needle, msg)


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
            ModelArch.from_hf_config({**TINY, "model_type": "nemotron", **change})


def test_the_nemotron_flags_are_no_longer_refused():
    spec = importlib.util.spec_from_file_location("count_refused_flags", ROOT / "scripts" / "count_refused_flags.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    megatron, relax = script.refused()
    refused = {dest for groups in (megatron, relax) for dests in groups.values() for dest in dests}
    assert not refused & set(NEMOTRON_FEATURES)
    assert "openai_gelu" in refused  # still an activation no supported family has
