"""Activation recompute, dropout and attention-backend flags: the combinations Megatron refuses, refused here
before Ray with the flags named (relax.config.validate calls `check`).

The rules follow Megatron-LM's own (`megatron/training/arguments.py` and `TransformerConfig.__post_init__`):
full recompute needs a method and a layer count, selective recompute takes neither.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from relax.config.errors import ConfigError

logger = logging.getLogger("relax")

# Selective recompute modules the models Relax builds have (relax.formats.model_arch): no multi-latent
# attention (mla_up_proj) and no grouped-GEMM experts (moe_act needs --moe-grouped-gemm); shared_experts only in
# models with a shared expert (Qwen2-MoE), which the trainer checks once it has read the model.
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "shared_experts")
NOT_BUILT_MODULES = {
    "mla_up_proj": "needs multi-latent attention, which no supported model family has",
    "moe_act": "needs --moe-grouped-gemm, which the trainer does not use (its experts are separate linear layers)",
}
# Attention backends that are Transformer Engine's GPU kernels (flash attention, cuDNN fused attention).
TE_ATTENTION_BACKENDS = ("flash", "fused")
TE_FALLBACK = ("--attention-backend %s selects Transformer Engine's GPU attention kernels, and this machine has no "
               "CUDA device or no transformer_engine: the trainer runs Megatron's own (unfused) attention instead, "
               "the same computation without the fused kernel")


def _name(value: Any) -> Any:
    return getattr(value, "name", value)  # Megatron's parser gives enums for --attention-backend


def check_recompute(v: dict, explicit) -> None:
    granularity, method = v.get("recompute_granularity"), v.get("recompute_method")
    layers = v.get("recompute_num_layers")
    modules = v.get("recompute_modules")
    if v.get("recompute_activations"):
        # Megatron: --recompute-activations is shorthand for --recompute-granularity selective.
        if granularity == "full":
            raise ConfigError("--recompute-activations means --recompute-granularity selective; it contradicts "
                              "--recompute-granularity full (drop one of them)")
        granularity = "selective"
    replay = v.get("use_routing_replay") or v.get("use_rollout_routing_replay")
    if granularity is not None and replay and (v.get("pipeline_model_parallel_size") or 1) > 1:
        raise ConfigError("routing replay (--use-routing-replay / --use-rollout-routing-replay) with activation "
                          "recompute (--recompute-granularity) and --pipeline-model-parallel-size > 1 is not built: "
                          "a micro-batch's backward recompute would replay a later micro-batch's routes")
    if granularity is None:
        given = [f for f, val in (("--recompute-method", method), ("--recompute-num-layers", layers),
                                  ("--recompute-modules", modules)) if val is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without "
                              "--recompute-granularity; add --recompute-granularity full (method and layers) or "
                              "selective (modules)")
        return
    if granularity == "full":
        if method is None or layers is None:
            missing = [f for f, val in (("--recompute-method uniform|block", method),
                                        ("--recompute-num-layers N", layers)) if val is None]
            raise ConfigError(f"--recompute-granularity full needs {' and '.join(missing)} (Megatron's rule: which "
                              "layers are recomputed, in chunks of N (uniform) or the first N of each stage (block))")
        per_stage = (v.get("num_layers") or 0) // max(1, v.get("pipeline_model_parallel_size") or 1)
        if layers < 1 or (per_stage and layers > per_stage):
            upper = f" and the layers per pipeline stage ({per_stage})" if per_stage else ""
            raise ConfigError(f"--recompute-num-layers must be between 1{upper}, got {layers}")
        if modules is not None:
            raise ConfigError("--recompute-modules applies to --recompute-granularity selective; full recompute "
                              "recomputes whole layers (drop --recompute-modules)")
        return
    # selective
    if method is not None or layers is not None:
        given = [f for f, val in (("--recompute-method", method), ("--recompute-num-layers", layers))
                 if val is not None]
        raise ConfigError(f"--recompute-granularity selective does not take {' or '.join(given)} (Megatron's rule: "
                          "selective recompute picks submodules with --recompute-modules); drop them, or use "
                          "--recompute-granularity full")
    for module in modules or ():
        if module == "layernorm" and not te_available():
            raise ConfigError("--recompute-modules layernorm: Megatron-core recomputes norms with its "
                              "CheckpointWithoutOutput, which (megatron-core 0.16) calls Transformer Engine even "
                              "without fp8; this machine has no CUDA device or no transformer_engine. Drop layernorm "
                              "(core_attn, mlp and moe run here)")
        if module in NOT_BUILT_MODULES:
            raise ConfigError(f"--recompute-modules {module}: {NOT_BUILT_MODULES[module]}")
        if module not in RECOMPUTE_MODULES:
            raise ConfigError(f"--recompute-modules: unknown module {module!r}; choose from "
                              f"{', '.join(RECOMPUTE_MODULES)}")


def te_available() -> bool:
    """Transformer Engine can run: CUDA and the transformer_engine package are present (the trainer then builds
    the Transformer Engine layer spec, relax.backends.megatron.model.te_available)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    import torch  # only when Transformer Engine is installed: importing torch takes seconds

    return torch.cuda.is_available()


def check_dropout_and_kernels(v: dict, explicit) -> None:
    for dest in ("hidden_dropout", "attention_dropout"):
        p = v.get(dest)
        if p is not None and not 0.0 <= p < 1.0:
            raise ConfigError(f"--{dest.replace('_', '-')} is a dropout probability in [0, 1), got {p}")
    backend = _name(v.get("attention_backend"))
    if backend in TE_ATTENTION_BACKENDS and not te_available():
        # A kernel choice, not a different model: Megatron's own attention computes the same softmax attention, so
        # the same launch script runs (scaled down) on a CPU machine; said once here, before Ray.
        logger.warning(TE_FALLBACK, backend)


def check(v: dict, explicit) -> None:
    check_recompute(v, explicit)
    check_dropout_and_kernels(v, explicit)
