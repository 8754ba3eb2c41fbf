"""Cross-flag rules of LoRA (--lora-*), run before Ray with relax.config.rules_training.RULES: functions
(values, explicit) -> None raising ConfigError that names the flags and the fix.

What is built (relax/backends/megatron/lora.py, docs/lora.md): adapters on the dense column- and row-parallel
linears of Megatron-core's local layer spec, trained with a frozen base, synced to the engines as the adapter
alone (the embedded engine or real SGLang, relax.backends.megatron.lora_sync) or as merged weights
(--lora-merge-sync). Everything else a --lora-* combination would need is refused here, not silently ignored.
"""

from __future__ import annotations

from pathlib import Path

from relax.config.errors import ConfigError

# Megatron-core's names of a transformer layer's linears: column-parallel (output dim split over TP) and
# row-parallel (input dim split)
COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
ROW_TARGETS = ("linear_proj", "linear_fc2")
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ALL_LINEAR = "all-linear"
LORA_INITS = ("kaiming", "gaussian")
# modules trained in full beside the adapters (PEFT's modules_to_save), by Megatron name
LORA_SAVE_MODULES = ("output_layer",)
# the defaults of the flags that mean something only with --lora-rank (relax.config.flags.lora uses them): a value
# equal to its default, as a resolved config file restates it, is not a setting of its own
LORA_DEFAULTS = {"lora_alpha": 16.0, "lora_dropout": 0.0, "lora_target_modules": [ALL_LINEAR], "lora_init": "kaiming",
                 "lora_load": None, "lora_merge_sync": False, "lora_modules_to_save": []}
LORA_FLAGS = tuple(LORA_DEFAULTS)
# the name the trainer loads its adapter under on the engines and the rollout's requests name (SGLang's lora_path)
ADAPTER_NAME = "policy"


def adapter_sync(config) -> bool:
    """Whether each weight push moves only the LoRA adapter (--lora-rank without --lora-merge-sync)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    return bool(get("lora_rank", 0)) and not get("lora_merge_sync", False)


def lora_targets(v: dict) -> tuple[str, ...]:
    """The Megatron linears that get adapters, in LORA_TARGETS order (all-linear: all four)."""
    given = v.get("lora_target_modules") or [ALL_LINEAR]
    return LORA_TARGETS if ALL_LINEAR in given else tuple(t for t in LORA_TARGETS if t in given)


def check_values(v: dict, explicit) -> None:
    rank = v.get("lora_rank") or 0
    if rank < 0:
        raise ConfigError(f"--lora-rank {rank}: must be >= 0 (0 turns LoRA off)")
    if rank == 0:
        given = [f"--{d.replace('_', '-')}" for d in LORA_FLAGS if d in explicit and v.get(d) != LORA_DEFAULTS[d]]
        if given:
            raise ConfigError(f"{', '.join(given)} set without --lora-rank: they do nothing with LoRA off; add "
                              "--lora-rank R (R > 0) or drop them")
        return
    if not v["lora_alpha"] or v["lora_alpha"] <= 0:
        raise ConfigError(f"--lora-alpha {v['lora_alpha']}: must be > 0 (the adapters' scale is alpha / rank)")
    if not 0.0 <= v["lora_dropout"] < 1.0:
        raise ConfigError(f"--lora-dropout {v['lora_dropout']}: must be in [0, 1)")
    given = list(v.get("lora_target_modules") or [])
    unknown = [t for t in given if t not in LORA_TARGETS + (ALL_LINEAR,)]
    if unknown:
        raise ConfigError(f"--lora-target-modules {' '.join(unknown)}: unknown; use Megatron's names "
                          f"{', '.join(LORA_TARGETS)} or {ALL_LINEAR}")
    if not given:
        raise ConfigError(f"--lora-target-modules: give at least one of {', '.join(LORA_TARGETS)} or {ALL_LINEAR}")
    unknown = [m for m in v.get("lora_modules_to_save") or [] if m not in LORA_SAVE_MODULES]
    if unknown:
        raise ConfigError(f"--lora-modules-to-save {' '.join(unknown)}: unknown; use Megatron's names "
                          f"({', '.join(LORA_SAVE_MODULES)})")
    if v["lora_load"] and not Path(v["lora_load"]).exists():
        raise ConfigError(f"--lora-load {v['lora_load']}: no such folder (give a PEFT adapter folder, or the --save "
                          "folder or an iter_* folder of a LoRA run)")


def check_combinations(v: dict, explicit) -> None:
    """Combinations LoRA cannot serve yet, refused with what to do instead."""
    if not v.get("lora_rank"):
        return
    if adapter_sync(v):
        _check_adapter_sync(v)
    if v.get("lora_modules_to_save") and v.get("save_hf"):
        raise ConfigError("not supported yet: --save-hf with --lora-modules-to-save (the PEFT export of a trained "
                          "module beside the adapters); drop --save-hf (--save keeps both)")
    if v["only_train_params_name_list"] or v["freeze_params_name_list"]:
        raise ConfigError("--lora-rank trains the adapters only (the base is frozen): drop "
                          "--only-train-params-name-list / --freeze-params-name-list")
    if v["advantage_estimator"] == "ppo" or v.get("critic_train_only"):
        raise ConfigError("not supported yet: --lora-rank with a critic (--advantage-estimator ppo); use "
                          "grpo/gspo/reinforce_plus_plus/rloo, or drop --lora-rank")
    if (v.get("num_experts") or 0) > 0 and {"linear_fc1", "linear_fc2"} & set(lora_targets(v)):
        raise ConfigError("not supported yet: LoRA on MoE expert layers (--num-experts with --lora-target-modules "
                          "linear_fc1/linear_fc2/all-linear); use --lora-target-modules linear_qkv linear_proj")
    if v.get("save_hf") and (v.get("pipeline_model_parallel_size") or 1) > 1:
        raise ConfigError("not supported yet: --save-hf with --lora-rank and --pipeline-model-parallel-size > 1 (the "
                          "PEFT adapter is written as one file); drop --save-hf or use PP 1")
    impl = getattr(v.get("transformer_impl"), "name", v.get("transformer_impl"))
    backend = getattr(v.get("attention_backend"), "name", v.get("attention_backend"))
    if impl != "local" and backend != "local" and _driver_has_gpu():
        raise ConfigError("not supported yet: --lora-rank with Transformer Engine layers (a GPU with "
                          "transformer_engine); add --transformer-impl local")


def _check_adapter_sync(v: dict) -> None:
    """Adapter-only sync (relax.backends.megatron.lora_sync) where it can work: the embedded engine or real SGLang
    (launched with LoRA, relax.roles.engine.lora_server_args), with the engines taking the adapter at every push.
    Each refusal names --lora-merge-sync, which works in every case below."""
    backend = _rollout_backend(v)
    why = None
    if v.get("lora_modules_to_save"):
        why = "--lora-modules-to-save: the engines would need the trained module beside the adapter"
    elif backend == "sglang" and v.get("check_weight_update_equal"):
        why = ("--rollout-backend sglang and --check-weight-update-equal: SGLang's /load_lora_adapter reports no "
               "checksum of what it loaded (the embedded engine's does), so the adapter cannot be compared")
    elif v.get("lora_load"):
        why = "--lora-load: the engines would serve the base until the first push"
    elif v.get("pretrained_checkpoint") or v.get("finetune") or v.get("start_rollout_id") is not None:
        why = ("--pretrained-checkpoint / --finetune / --start-rollout-id: the engines would keep --hf-checkpoint's "
               "base, or serve the base at a version above 0")
    elif v.get("use_fault_tolerance") or v.get("autoscaler_config"):
        why = ("--use-fault-tolerance / --autoscaler-config: a replacement engine is given the kept full weights, "
               "not the adapter")
    elif (v.get("pipeline_model_parallel_size") or 1) > 1:
        why = "--pipeline-model-parallel-size > 1: the adapter is sent as one PEFT file"
    elif v.get("colocate"):
        why = "--colocate: not tested with an adapter on the engines"
    if why:
        raise ConfigError(f"not supported yet: adapter-only sync (--lora-rank without --lora-merge-sync) with {why}; "
                          "add --lora-merge-sync (the engines then receive merged weights)")


def check_sglang_cpu_mlp(v: dict, explicit) -> None:
    """Adapter-only sync to real SGLang on CPU with MLP targets: SGLang (0.5.23) pads the MLP's intermediate size to
    a multiple of 32 x TP on CPU, and its LoRA buffers take the padded size, so an adapter of the model's own size
    fails to load into them at the first request naming it (an AssertionError in the engine's scheduler, which
    exits). Refused before Ray for such a model; reads config.json only."""
    if not adapter_sync(v) or not {"linear_fc1", "linear_fc2"} & set(lora_targets(v)):
        return
    if _rollout_backend(v) != "sglang" or not v.get("hf_checkpoint"):
        return
    from relax.config.facts import driver_has_gpu

    if driver_has_gpu():
        return
    import json

    config_json = Path(v["hf_checkpoint"]) / "config.json"
    if not config_json.is_file():
        return
    hf = json.loads(config_json.read_text())
    size = hf.get("intermediate_size") or (hf.get("text_config") or {}).get("intermediate_size")
    pad = 32 * (v.get("rollout_num_gpus_per_engine") or 1)
    if isinstance(size, int) and size % pad:
        raise ConfigError("not supported yet: adapter-only sync (--lora-rank without --lora-merge-sync) to real "
                          f"SGLang on CPU with MLP targets for this model: SGLang pads its intermediate_size {size} "
                          f"to a multiple of {pad} on CPU and its LoRA buffers then do not fit the adapter; add "
                          "--lora-merge-sync, or use --lora-target-modules linear_qkv linear_proj")


def _rollout_backend(v: dict) -> str:
    """--rollout-backend with "auto" resolved as validation's derive step will (these rules run before it)."""
    backend = v.get("rollout_backend")
    if backend == "auto":
        from relax.config.sglang import resolve_backend

        backend = resolve_backend(backend)
    return backend


def _driver_has_gpu() -> bool:
    from relax.config.facts import driver_has_gpu

    if not driver_has_gpu():
        return False
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def check_moe_model(v: dict, explicit) -> None:
    """An MoE model read from --hf-checkpoint (its config.json) with expert targets: refused before Ray."""
    if not v.get("lora_rank") or not {"linear_fc1", "linear_fc2"} & set(lora_targets(v)):
        return
    from relax.config.rules_arch import hf_arch  # reads config.json only when LoRA asks for MLP targets

    arch = hf_arch(v) if v.get("hf_checkpoint") else None
    if arch is not None and arch.is_moe:
        raise ConfigError(f"not supported yet: LoRA on MoE expert layers (--hf-checkpoint {v['hf_checkpoint']} is an "
                          "MoE model; --lora-target-modules linear_fc1/linear_fc2/all-linear); use "
                          "--lora-target-modules linear_qkv linear_proj")


RULES: tuple = (check_values, check_combinations, check_moe_model, check_sglang_cpu_mlp)
