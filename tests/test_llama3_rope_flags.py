"""Llama 3.1's model flag file (--use-rope-scaling --rotary-scaling-factor 8.0) against the model's config.json,
before Ray: accepted when the flags describe the HF config's llama3 scaling (--rotary-scaling-factor with a no-effect
warning, as Megatron reads it only for multi-latent attention), refused naming the flags when the factor or one of
the parameters Megatron fixes (low/high frequency factors, original context length) differs."""

import importlib.util
from pathlib import Path

import pytest
from transformers import AutoConfig, LlamaConfig

from relax.formats.model_arch import ModelArch, arch_for_run
from relax.config import ConfigError, parse_config
from launch_files import flag_run, model_args
from relax.config.support import no_effect_flags, no_effect_warnings, require_supported, unsupported_flags

ROOT = Path(__file__).resolve().parents[1]

# Llama-3.1-8B's config.json (the flag file's model)
LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                  max_position_embeddings=131072, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192})


def _config_dir(tmp_path, name, **changes):
    rope = {**LLAMA31_8B["rope_parameters"], **changes}
    LlamaConfig(**{**LLAMA31_8B, "rope_parameters": rope}).save_pretrained(tmp_path / name)  # all the checks read
    return tmp_path / name


def test_the_llama31_flag_file_runs_unchanged_and_builds_the_hf_configs_model(prompt_file, tmp_path):
    args = model_args("llama3.1-8B-Instruct.sh")
    assert {"--use-rope-scaling", "--rotary-scaling-factor"} <= set(args)
    folder = _config_dir(tmp_path, "llama31")
    config = parse_config(flag_run(folder, prompt_file, tmp_path, *args))
    assert unsupported_flags(config) == []
    require_supported(config)
    hf = ModelArch.from_hf_config(AutoConfig.from_pretrained(folder))
    assert hf.rope_scaling_factor == 8.0 and hf.llama3_rope_off_megatron() == {}
    assert arch_for_run(config) == hf == ModelArch.from_flags(config)
    # --rotary-scaling-factor: accepted with a warning that names the flag Megatron's llama3 scaling reads
    assert no_effect_flags(config) == ["--rotary-scaling-factor"]
    (warning,) = no_effect_warnings(no_effect_flags(config))
    assert "multi-latent attention" in warning and "--rope-scaling-factor" in warning


def test_a_rotary_scaling_factor_other_than_the_models_is_refused_naming_both_flags(prompt_file, tmp_path):
    folder = _config_dir(tmp_path, "llama31")
    args = [a if a != "8.0" else "4.0" for a in model_args("llama3.1-8B-Instruct.sh")]
    with pytest.raises(ConfigError) as exc:
        parse_config(flag_run(folder, prompt_file, tmp_path, *args))
    msg = str(exc.value)
    assert "--rotary-scaling-factor 4.0: Megatron reads it only for multi-latent attention" in msg, msg
    assert "the HF config's rope_scaling.factor, 8.0 (set --rope-scaling-factor" in msg, msg
    # without a config.json to read (a --dry-run for another machine) it is compared with --rope-scaling-factor
    with pytest.raises(ConfigError, match=r"--rotary-scaling-factor 4.0: .* uses --rope-scaling-factor, 8.0"):
        parse_config(flag_run(tmp_path / "elsewhere", prompt_file, tmp_path, *args))
    # and so is --rope-scaling-factor itself
    with pytest.raises(ConfigError, match=r"--rope-scaling-factor 32.0: the HF config gives 8.0"):
        parse_config(flag_run(folder, prompt_file, tmp_path, *model_args("llama3.1-8B-Instruct.sh"),
                          "--rope-scaling-factor", "32"))


@pytest.mark.parametrize("changes", [{"low_freq_factor": 2.0}, {"original_max_position_embeddings": 4096}])
def test_llama3_parameters_megatron_fixes_are_checked_against_the_config(prompt_file, tmp_path, changes):
    # Megatron's --use-rope-scaling fixes them at Llama 3.1's; a config with others is another model
    folder = _config_dir(tmp_path, "other", **changes)
    with pytest.raises(ConfigError) as exc:
        parse_config(flag_run(folder, prompt_file, tmp_path, *model_args("llama3.1-8B-Instruct.sh")))
    ((name, value),) = changes.items()
    msg = str(exc.value)
    assert f"--use-rope-scaling: Megatron's llama3 RoPE scaling fixes {name}" in msg, msg
    assert f"the HF config's rope_scaling gives {name} {value}" in msg and "drop --use-rope-scaling" in msg, msg
    # without the flags the HF config's scaling is built, all four parameters
    args = [a for a in model_args("llama3.1-8B-Instruct.sh") if a != "--use-rope-scaling"]
    config = parse_config(flag_run(folder, prompt_file, tmp_path, *args))
    assert arch_for_run(config).llama3_rope_off_megatron() == {name: (value, 1.0 if name == "low_freq_factor"
                                                                      else 8192)}


def test_no_launch_file_flag_is_refused_without_a_hardware_or_dependency_reason():
    spec = importlib.util.spec_from_file_location("count_refused_flags", ROOT / "scripts" / "count_refused_flags.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    megatron, relax = script.refused()
    refused = {dest for groups in (megatron, relax) for dests in groups.values() for dest in dests}
    assert not refused & {"use_rope_scaling", "rope_scaling_factor", "rotary_scaling_factor"}
    count, lines = script.launch_report()
    assert count == 0, lines
    # Llama 3.1's flags are accepted; the fully-async script's Megatron-Bridge conversion is refused with its reason
    flags = script.launch_flags([ROOT / "examples" / "launch" / "models" / "llama3.1-8B-Instruct.sh",
                                 ROOT / "examples" / "launch" / "run-grpo-fully-async.sh"])
    assert {name: script.launch_status(dest, value) for name, (dest, value, _) in flags.items()
            if name.startswith(("--use-rope", "--rotary-scaling", "--megatron-to-hf"))} == {
        "--use-rope-scaling": "accepted", "--rotary-scaling-factor": "accepted",
        "--megatron-to-hf-mode bridge": "dependency"}
    assert any(line.startswith("  refused for a dependency reason: --megatron-to-hf-mode bridge") and
               "transformers<5.0.0" in line for line in lines), lines
