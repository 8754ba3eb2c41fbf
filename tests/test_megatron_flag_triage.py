"""Every mirrored Megatron flag is in exactly one category (relax.config.support_megatron): built, no effect in
Relax (accepted with a warning naming what Relax does instead), GPU-only (refused on a CPU-only run with the
reason) or not supported yet (refused, by group with the reason). The GPU-only switches added here reach
Megatron's config objects, and the flags that ask for what the trainer always builds are what it builds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relax.config import ConfigError, parse_config
from relax.config.explain import explain
from relax.config.megatron_mirror import ROWS
from relax.config.parser import actions_by_dest, build_parser
from relax.config.support import IMPLEMENTED, no_effect_flags, no_effect_warning, require_supported, unsupported_flags
from relax.config.support_gpu import GPU_ONLY_FEATURES, require_gpu_for
from relax.config.support_megatron import ALWAYS_SO, NO_EFFECT_REASONS, NOT_BUILT, refused_groups


def _mirror_dests() -> set[str]:
    parser, _ = build_parser(use_megatron_parser=False)
    return {row[2] for row in ROWS} & set(actions_by_dest(parser))


def test_every_megatron_flag_is_in_exactly_one_category():
    dests = _mirror_dests()
    built = dests & (IMPLEMENTED - GPU_ONLY_FEATURES)
    no_effect = dests & set(NO_EFFECT_REASONS)
    gpu = dests & GPU_ONLY_FEATURES
    refused = dests - IMPLEMENTED - GPU_ONLY_FEATURES - set(NO_EFFECT_REASONS)
    groups = [set(flags) for _, flags in NOT_BUILT.values()]
    assert not (set(NO_EFFECT_REASONS) & IMPLEMENTED) and not (set(NO_EFFECT_REASONS) & GPU_ONLY_FEATURES)
    assert set(ALWAYS_SO) <= IMPLEMENTED
    assert len(built) + len(no_effect) + len(gpu) + len(refused) == len(dests)
    # every refused Megatron flag is in one group that says why, and no group names a flag twice
    assert refused <= set().union(*groups), sorted(refused - set().union(*groups))
    assert sum(len(g) for g in groups) == len(set().union(*groups))
    left = refused_groups(IMPLEMENTED)
    assert sum(len(d) for _, d in left.values()) == len(refused)
    print(f"\nMegatron flags: {len(dests)} = built {len(built)} + no effect {len(no_effect)} + GPU-only {len(gpu)} "
          f"+ not supported yet {len(refused)}")
    for group, (_, flags) in left.items():
        print(f"  not supported yet, {group}: {len(flags)}")


def test_a_no_effect_flag_warns_naming_it_and_is_not_refused(tmp_path):
    config = parse_config(["--output-dir", str(tmp_path), "--log-interval", "1", "--tokenizer-type",
                           "HuggingFaceTokenizer", "--no-check-for-nan-in-loss-and-grad", "--model-name", "qwen3"])
    assert unsupported_flags(config) == []
    require_supported(config)
    assert no_effect_flags(config) == ["--no-check-for-nan-in-loss-and-grad", "--log-interval", "--model-name",
                                       "--tokenizer-type"]
    lines = no_effect_warning(no_effect_flags(config)).split("\nrelax-train: warning: ")
    assert len(lines) == 4  # one warning per flag
    assert "--log-interval has no effect: Relax logs every rollout step's metrics" in lines[1]
    assert "--tokenizer-type has no effect: tokens come from the Hugging Face tokenizer of --hf-checkpoint" in lines
    # a flag left at its default (or restated) warns about nothing
    assert no_effect_flags(parse_config(["--output-dir", str(tmp_path), "--log-interval", "100"])) == []
    # --dry-run lists them in their own section, with the reasons
    text = explain(config)
    assert "accepted, no effect in Relax (a real run warns once for each):" in text
    assert "  --model-name has no effect: the weight converter is chosen from the model's family" in text
    assert text.splitlines()[-1] == "every flag you set is supported"


def test_no_effect_reasons_name_what_relax_does_and_cover_no_model_or_math_flag():
    # the flags that change the model, the loss, parallelism, precision or the optimizer are never "no effect"
    math = {"init_method_std", "moe_aux_loss_coeff", "fp32_residual_connection", "overlap_grad_reduce", "fp8",
            "lr_warmup_init", "loss_scale", "yaml_cfg", "batch_size", "apply_query_key_layer_scaling",
            "deterministic_mode", "grad_reduce_in_bf16", "main_grads_dtype", "iterations_to_skip"}
    assert not math & set(NO_EFFECT_REASONS)
    assert all(len(reason) > 30 for reason in NO_EFFECT_REASONS.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_gpu_only_flags_are_refused_on_a_cpu_only_local_run_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for flag, reason in [("--moe-router-fusion", "Transformer Engine's fused kernels"),
                         ("--use-torch-optimizer-for-cpu-offload", "--optimizer-cpu-offload"),
                         ("--disable-bf16-reduced-precision-matmul", "cuBLAS")]:
        config = parse_config(["--output-dir", str(tmp_path), flag])
        assert unsupported_flags(config) == []
        with pytest.raises(ConfigError, match=f"needs a GPU, and this machine has none: {flag} .*{reason}"):
            require_gpu_for(config)


def test_a_refused_flag_still_says_not_supported_yet(tmp_path):
    config = parse_config(["--output-dir", str(tmp_path), "--init-model-with-meta-device", "--tp-comm-overlap"])
    assert unsupported_flags(config) == ["--init-model-with-meta-device", "--tp-comm-overlap"]
    with pytest.raises(ConfigError, match="not supported yet: --init-model-with-meta-device, --tp-comm-overlap"):
        require_supported(config)
    lines = explain(config).splitlines()
    assert lines[-1].startswith("not supported yet (a real run stops before starting Ray): --init-model-with-meta")
    assert any(line.startswith("not built (model initialisation): --init-model-with-meta-device;") for line in lines)


def test_the_new_gpu_switches_reach_megatrons_config_objects(tmp_path, monkeypatch):
    from megatron.core.optimizer import OptimizerConfig

    import relax.backends.megatron.layer_options as layer_options
    import relax.backends.megatron.optim as optim
    from relax.backends.megatron.transformer_config import to_transformer_config
    from relax.formats.model_arch import ModelArch
    from relax.backends.megatron.trainer import TrainerSettings
    from relax.roles.megatron_settings import trainer_settings

    config = parse_config(["--output-dir", str(tmp_path), "--moe-router-fusion",
                           "--disable-bf16-reduced-precision-matmul", "--use-torch-optimizer-for-cpu-offload"])
    on = trainer_settings(config).gpu_features
    new = {"moe_router_fusion", "disable_bf16_reduced_precision_matmul", "use_torch_optimizer_for_cpu_offload"}
    assert new <= set(on)
    settings = TrainerSettings(gpu_features=on)
    if not torch.cuda.is_available():  # a CUDA-less trainer rank refuses them at its build
        with pytest.raises(ValueError, match="--moe-router-fusion needs Transformer Engine on a GPU"):
            layer_options.layer_fields(settings, te=False, is_moe=True)
        with pytest.raises(ValueError, match="--disable-bf16-reduced-precision-matmul needs a GPU"):
            layer_options.layer_fields(settings, te=True, is_moe=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU rank with Transformer Engine
    arch = ModelArch(num_layers=1, hidden_size=8, ffn_hidden_size=8, num_attention_heads=2, num_query_groups=2,
                     kv_channels=4, vocab_size=16, max_position_embeddings=8, num_experts=2, moe_router_topk=2,
                     moe_ffn_hidden_size=8, hf_family="qwen3_moe", qk_layernorm=True)
    fields = layer_options.layer_fields(settings, te=True, is_moe=True)
    built = to_transformer_config(arch, **fields)
    assert built.moe_router_fusion is True and built.disable_bf16_reduced_precision_matmul is True
    dense = layer_options.layer_fields(settings, te=True, is_moe=False)
    assert "moe_router_fusion" not in dense and dense["disable_bf16_reduced_precision_matmul"] is True

    seen: dict[str, OptimizerConfig] = {}

    def capture(cfg, models):
        seen["config"] = cfg
        raise RuntimeError("captured")

    monkeypatch.setattr("megatron.core.optimizer.get_megatron_optimizer", capture)
    with pytest.raises(RuntimeError, match="captured"):
        optim.build_optimizer(None, built, lr=1e-3, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                              adam_eps=1e-8, clip_grad=1.0, bf16=False, fp16=False, use_distributed_optimizer=False,
                              gpu_features=on)
    assert seen["config"].use_torch_optimizer_for_cpu_offload is True


def test_flags_asking_for_what_the_trainer_builds_are_what_it_builds(tmp_path):
    """The --no-*-fusion switches (and --only-load-weight: forward-only roles load weights only, no optimizer)."""
    from relax.backends.megatron.testing import build_random_tiny_model, ensure_single_process, hf_trainer
    from relax.roles.megatron_settings import trainer_settings

    flags = ["--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
             "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
             "--no-persist-layer-norm", "--no-overlap-p2p-communication", "--only-load-weight"]
    config = parse_config(["--output-dir", str(tmp_path), *flags])
    assert unsupported_flags(config) == [] and no_effect_flags(config) == []
    assert {dest for dest in ALWAYS_SO if config[dest] != build_parser()[0].get_default(dest)} == set(ALWAYS_SO)
    ensure_single_process()
    path = build_random_tiny_model(tmp_path / "m", "qwen2", seed=1)
    settings = trainer_settings(config, forward_only=True)
    trainer = hf_trainer(path, **{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)})
    for dest, (field, value) in ALWAYS_SO.items():
        assert getattr(trainer.config, field) == value, dest
    assert trainer.optimizer is None and trainer.scheduler is None  # --only-load-weight: weights only


def test_qkv_format_is_accepted_and_bshd_refuses_dynamic_batching(tmp_path):
    from relax.roles.megatron_settings import trainer_settings

    base = ["--output-dir", str(tmp_path)]
    thd = parse_config(base + ["--qkv-format", "thd", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"])
    bshd = parse_config(base + ["--qkv-format", "bshd", "--micro-batch-size", "2"])
    assert unsupported_flags(thd) == [] and unsupported_flags(bshd) == []
    with pytest.raises(ConfigError, match="--qkv-format bshd does not support --use-dynamic-batch-size"):
        parse_config(base + ["--qkv-format", "bshd", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"])
    # the layout does not reach the trainer: both run attention on right-padded micro-batches
    same = parse_config(base + ["--qkv-format", "thd", "--micro-batch-size", "2"])
    assert trainer_settings(bshd) == trainer_settings(same)
    assert unsupported_flags(parse_config(base + ["--train-backend", "megatron"])) == []


def test_a_real_run_warns_once_per_no_effect_flag(tmp_path, prompt_file):
    from conftest import relax_cli

    # a missing model folder stops the run before Ray, after the warnings
    proc = relax_cli("--log-interval", "1", "--train-iters", "5", "--hf-checkpoint", str(tmp_path / "no-model"),
                     "--prompt-data", prompt_file, "--rollout-batch-size", "1", "--num-rollout", "1",
                     "--output-dir", str(tmp_path))
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("relax-train: warning: ")]
    assert warnings == [
        "relax-train: warning: --log-interval has no effect: Relax logs every rollout step's metrics "
        "(<output-dir>/metrics.jsonl, --use-tensorboard)",
        "relax-train: warning: --train-iters has no effect: the run is --num-rollout (or --num-epoch) rollout "
        "steps of --num-steps-per-rollout optimizer steps"], proc.stderr
    assert "not supported yet" not in proc.stderr
