"""Activation recompute, dropout and attention backend of a `MegatronTrainer`, as Megatron-core's own
`TransformerConfig` fields.

Megatron-core implements all three; this module only turns `TrainerSettings` into those fields and refuses
the combinations Megatron cannot run here. The command-line checks, with flag names, are in
`relax.config.rules_recompute` and run before Ray; the checks here guard direct users of the trainer.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from megatron.core.transformer.enums import AttnBackend

from relax.backends.megatron.model import te_available
from relax.config.rules_recompute import TE_ATTENTION_BACKENDS, TE_FALLBACK

logger = logging.getLogger(__name__)

# TE_ATTENTION_BACKENDS need Transformer Engine's attention kernels on a GPU (TEDotProductAttention). The local
# layer spec, used on CPU, has one attention: Megatron's own unfused DotProductAttention ("local").
ATTENTION_BACKENDS = frozenset({"flash", "fused", "unfused", "local", "auto"})


def recompute_granularity(settings: Any) -> Optional[str]:
    """`settings.recompute_granularity`, else "full" for the older `recompute_activations` switch."""
    if settings.recompute_granularity:
        return settings.recompute_granularity
    return "full" if settings.recompute_activations else None


def recompute_fields(settings: Any, te: bool, is_moe: bool, shared_experts: bool = False) -> dict[str, Any]:
    """TransformerConfig recompute fields. Megatron validates them again in `TransformerConfig.__post_init__`;
    `te`: whether the model uses Transformer Engine's layer spec; `is_moe`: whether it has expert layers;
    `shared_experts`: whether its MoE layers have a shared expert (Qwen2-MoE)."""
    granularity = recompute_granularity(settings)
    if granularity is None:
        if settings.recompute_method or settings.recompute_num_layers or settings.recompute_modules:
            raise ValueError("recompute_method / recompute_num_layers / recompute_modules need a "
                             "recompute_granularity")
        return {}
    out: dict[str, Any] = {"recompute_granularity": granularity}
    if granularity == "full":
        # The older switch recomputes every layer one at a time (uniform, 1); explicit settings win.
        out["recompute_method"] = settings.recompute_method or "uniform"
        out["recompute_num_layers"] = settings.recompute_num_layers or 1
    elif settings.recompute_method or settings.recompute_num_layers:
        raise ValueError("selective recompute takes recompute_modules, not recompute_method / recompute_num_layers")
    if settings.recompute_modules and "layernorm" in settings.recompute_modules and not te:
        # CheckpointWithoutOutput (norm recompute) takes its fp8 path whatever fp8 is (megatron-core 0.16), and
        # that path calls Transformer Engine.
        raise ValueError("recompute module 'layernorm' needs Transformer Engine (megatron-core's "
                         "CheckpointWithoutOutput calls it); this model uses the local layer spec")
    if settings.recompute_modules and "moe" in settings.recompute_modules and not is_moe:
        # Megatron would silently recompute nothing: say so instead (the model comes from the HF config, so the
        # command-line check cannot know).
        raise ValueError("recompute module 'moe' needs an MoE model; this one is dense (use mlp)")
    if settings.recompute_modules and "shared_experts" in settings.recompute_modules and not shared_experts:
        # megatron-core's SharedExpertMLP is the only reader of the module name: without one it recomputes nothing
        raise ValueError("recompute module 'shared_experts' needs an MoE model with a shared expert "
                         "(--moe-shared-expert-intermediate-size, a Qwen2-MoE model); this one has none")
    if settings.recompute_modules:
        out["recompute_modules"] = list(settings.recompute_modules)
    return out


def attention_backend(name: str, te: bool):
    """Megatron's `AttnBackend` for `name`; `te`: whether the model uses Transformer Engine's layer spec.

    Megatron uses the field only to pick Transformer Engine's kernels, through the process-wide NVTE_FLASH_ATTN /
    NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN variables, and asserts that every model of a process agrees on them.
    Without Transformer Engine the local layer spec has one attention (Megatron's unfused DotProductAttention),
    which every backend then runs (flash and fused with a warning: they are Transformer Engine's GPU kernels);
    the field then stays Megatron's default, auto, so that models built in one process (actor, reference,
    tests) never disagree over variables nothing reads.
    """
    name = getattr(name, "name", name)  # Megatron's own parser gives the enum
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {sorted(ATTENTION_BACKENDS)}")
    if name in TE_ATTENTION_BACKENDS and not te:
        # The kernel is a speed choice; the local spec's attention computes the same function (see the docstring).
        logger.warning(TE_FALLBACK, name)
    return AttnBackend[name] if te else AttnBackend.auto


def uses_te(settings: Any) -> bool:
    """Whether the model gets Transformer Engine's layer spec: `settings.use_te`, else when CUDA and TE are
    present; never with the "local" attention backend, which is Megatron's own (Megatron asks for
    `--spec local` with it)."""
    if getattr(settings.attention_backend, "name", settings.attention_backend) == "local":
        return False
    return te_available() if settings.use_te is None else bool(settings.use_te)


# GPU-only TransformerConfig switches (relax.config.support_gpu), each the field of the same name:
# name -> (needs Transformer Engine, only for models with experts). Transformer Engine's MoE kernels need its layer
# spec; the bf16 matmul switch is a cuBLAS setting (torch.backends.cuda), which TransformerConfig applies with bf16.
TRANSFORMER_GPU_FEATURES: dict[str, tuple[bool, bool]] = {
    "moe_grouped_gemm": (True, True),
    "moe_permute_fusion": (True, True),
    "moe_router_fusion": (True, True),
    "disable_bf16_reduced_precision_matmul": (False, False),
}
MOE_GPU_FEATURES = tuple(name for name, (_, moe) in TRANSFORMER_GPU_FEATURES.items() if moe)


def layer_fields(settings: Any, te: bool, is_moe: bool = False, shared_experts: bool = False) -> dict[str, Any]:
    """Every TransformerConfig field this module owns, for `to_transformer_config(**fields)` (the MoE router's
    dtype only for models with experts)."""
    for name in ("hidden_dropout", "attention_dropout"):
        p = getattr(settings, name)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {p}")
    extra = {"moe_router_dtype": settings.moe_router_dtype} if is_moe and settings.moe_router_dtype else {}
    for name, (needs_te, moe_only) in TRANSFORMER_GPU_FEATURES.items():  # on GPU only
        if name not in settings.gpu_features or (moe_only and not is_moe):
            continue
        if not (te if needs_te else torch.cuda.is_available()):
            what = "Transformer Engine on a GPU" if needs_te else "a GPU"
            raise ValueError(f"--{name.replace('_', '-')} needs {what}, and this trainer rank has none "
                             "(relax.config.support_gpu says why)")
        extra[name] = True
    return {
        **recompute_fields(settings, te, is_moe, shared_experts),
        **extra,
        "hidden_dropout": float(settings.hidden_dropout),
        "attention_dropout": float(settings.attention_dropout),
        "attention_backend": attention_backend(settings.attention_backend, te),
    }
