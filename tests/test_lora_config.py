"""The --lora-* flags before Ray (relax/config/rules_lora.py): the values a run can use, and every combination that
cannot work yet refused with the flag to change."""

import pytest

from relax.config import parse_config
from relax.config.errors import ConfigError
from relax.config.support import require_supported, unsupported_flags

BASE = ["--hf-checkpoint", "unused-model-dir", "--rollout-batch-size", "2", "--n-samples-per-prompt", "3",
        "--global-batch-size", "6"]


def _config(*args):
    return parse_config([*BASE, *args])


def test_lora_off_by_default_and_on_with_merge_sync():
    config = _config()
    assert config.lora_rank == 0 and not config.lora_merge_sync
    config = _config("--lora-rank", "8", "--lora-merge-sync", "--lora-alpha", "32", "--lora-target-modules",
                     "linear_qkv", "linear_proj", "--lora-init", "gaussian", "--lora-dropout", "0.1")
    require_supported(config)
    assert unsupported_flags(config) == []
    from relax.backends.megatron.lora import lora_settings

    settings = lora_settings(config)
    assert (settings.rank, settings.alpha, settings.targets, settings.init, settings.dropout) == (
        8, 32.0, ("linear_qkv", "linear_proj"), "gaussian", 0.1)
    assert settings.scale == 4.0
    assert lora_settings(_config()) is None
    assert lora_settings(_config("--lora-rank", "4", "--lora-merge-sync")).targets == (
        "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # all-linear


def test_adapter_only_sync_is_taken_on_the_embedded_engine():
    from relax.config.rules_lora import adapter_sync

    config = _config("--lora-rank", "8", "--rollout-backend", "embedded")
    require_supported(config)
    assert adapter_sync(config) and not adapter_sync(_config("--lora-rank", "8", "--lora-merge-sync"))
    assert not adapter_sync(_config())


def test_sglang_target_modules_are_the_models_own_projection_names():
    """SGLang's --lora-target-modules name the HF projections of the model itself, by the naming rule the weight
    conversion uses (relax.formats.hf_names): GLM4's fused gate_up_proj, no gate_proj in a non-gated MLP."""
    import dataclasses

    from relax.config.rules_arch import _embedded_arch
    from relax.formats.hf_names import lora_hf_modules

    arch = _embedded_arch()
    mlp = ["linear_fc1", "linear_fc2"]
    assert lora_hf_modules(arch, ["linear_qkv", "linear_proj", *mlp]) == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    glm4 = dataclasses.replace(arch, hf_family="glm4", rotary_interleaved=True, rotary_percent=0.5,
                               post_self_attn_layernorm=True, post_mlp_layernorm=True)
    assert lora_hf_modules(glm4, mlp) == ["gate_up_proj", "down_proj"]
    nemotron = dataclasses.replace(arch, hf_family="nemotron", swiglu=False, squared_relu=True,
                                   layernorm_zero_centered_gamma=True, normalization="LayerNorm")
    assert lora_hf_modules(nemotron, mlp) == ["up_proj", "down_proj"]


def test_adapter_only_sync_to_real_sglang_launches_it_with_lora(tmp_path, monkeypatch):
    """Real SGLang takes the adapter (tests/test_sglang_lora.py): its engines are launched with LoRA sized for the
    run's rank and targets (HF names), the backend left to SGLang (torch_native on CPU, the server's default); the
    --sglang-* flags win. On CPU a model whose MLP SGLang pads is refused with MLP targets."""
    import json

    from relax.backends.sglang.server import cpu_server_args
    from relax.config import facts
    from relax.config.rules_lora import adapter_sync
    from relax.models.tiny import TinyArch, build_tiny_model_dir
    from relax.roles.engine import lora_server_args

    config = _config("--lora-rank", "8", "--rollout-backend", "sglang")
    require_supported(config)
    assert adapter_sync(config)
    assert lora_server_args(config) == {
        "enable_lora": True, "max_lora_rank": 8, "max_loras_per_batch": 2,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    config = _config("--lora-rank", "4", "--rollout-backend", "sglang", "--lora-target-modules", "linear_proj")
    assert lora_server_args(config)["lora_target_modules"] == ["o_proj"]
    assert lora_server_args(_config("--lora-rank", "4", "--lora-merge-sync", "--rollout-backend", "sglang")) == {}
    assert cpu_server_args({"enable_lora": True})["lora_backend"] == "torch_native"
    assert cpu_server_args({"enable_lora": True, "lora_backend": "triton"})["lora_backend"] == "triton"
    assert "lora_backend" not in cpu_server_args({})

    model = build_tiny_model_dir(tmp_path / "m", TinyArch(intermediate_size=176))
    monkeypatch.setattr(facts, "driver_has_gpu", lambda: False)
    args = ["--hf-checkpoint", str(model), "--lora-rank", "8", "--rollout-backend", "sglang"]
    with pytest.raises(ConfigError, match="SGLang pads its intermediate_size 176 to a multiple of 32"):
        parse_config([*BASE[2:], *args])
    parse_config([*BASE[2:], *args, "--lora-target-modules", "linear_qkv", "linear_proj"])
    parse_config([*BASE[2:], *args, "--lora-merge-sync"])
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 192}))
    parse_config([*BASE[2:], *args])


@pytest.mark.parametrize("args, message", [
    (["--lora-rank", "8", "--rollout-backend", "sglang", "--check-weight-update-equal"],
     "not supported yet: adapter-only sync (--lora-rank without --lora-merge-sync) with --rollout-backend sglang and "
     "--check-weight-update-equal"),
    (["--lora-rank", "8", "--lora-load", "."], "adapter-only sync (--lora-rank without --lora-merge-sync) with "
                                               "--lora-load"),
    (["--lora-rank", "8", "--use-fault-tolerance"], "with --use-fault-tolerance / --autoscaler-config"),
    (["--lora-rank", "8", "--colocate"], "with --colocate"),
    (["--lora-rank", "-2", "--lora-merge-sync"], "--lora-rank -2: must be >= 0"),
    (["--lora-alpha", "8"], "--lora-alpha set without --lora-rank"),
    (["--lora-merge-sync"], "--lora-merge-sync set without --lora-rank"),
    (["--lora-rank", "8", "--lora-merge-sync", "--lora-alpha", "0"], "--lora-alpha 0"),
    (["--lora-rank", "8", "--lora-merge-sync", "--lora-dropout", "1"], "--lora-dropout 1"),
    (["--lora-rank", "8", "--lora-merge-sync", "--lora-target-modules", "q_proj"],
     "--lora-target-modules q_proj: unknown; use Megatron's names"),
    (["--lora-rank", "8", "--lora-merge-sync", "--lora-load", "/no/such/adapter"], "--lora-load /no/such/adapter"),
    (["--lora-rank", "8", "--lora-merge-sync", "--advantage-estimator", "ppo"],
     "not supported yet: --lora-rank with a critic"),
    (["--lora-rank", "8", "--lora-merge-sync", "--only-train-params-name-list", "linear_qkv"],
     "drop --only-train-params-name-list"),
    (["--lora-rank", "8", "--lora-merge-sync", "--num-experts", "4"], "not supported yet: LoRA on MoE expert layers"),
    (["--lora-rank", "8", "--lora-merge-sync", "--save-hf", "/tmp/hf", "--pipeline-model-parallel-size", "2",
      "--resource", '{"actor": [1, 2], "rollout": [1, 1]}'], "not supported yet: --save-hf with --lora-rank and"),
])
def test_refusals_name_the_flag_and_the_fix(args, message):
    with pytest.raises(ConfigError) as err:
        _config(*args)
    assert message in str(err.value)


def test_moe_model_refuses_mlp_targets_but_takes_attention(tmp_path):
    from relax.backends.megatron.testing import build_random_tiny_moe_model

    moe = str(build_random_tiny_moe_model(tmp_path / "moe"))
    args = ["--hf-checkpoint", moe, "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--global-batch-size",
            "6", "--lora-rank", "4", "--lora-merge-sync"]
    with pytest.raises(ConfigError, match="MoE expert layers.*--lora-target-modules linear_qkv linear_proj"):
        parse_config(args)
    assert parse_config([*args, "--lora-target-modules", "linear_qkv", "linear_proj"]).lora_rank == 4
