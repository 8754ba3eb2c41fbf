"""Megatron-core training backend (CPU over gloo, GPU over NCCL, same code).

Modules, one job each:
    cpu_compat  patches that let megatron-core run without CUDA (the only CUDA-aware module)
    arch        ModelArch (from an HF config) and the Megatron TransformerConfig
    parallel    torch.distributed and Megatron parallel-state setup
    model       GPTModel construction (local spec on CPU, Transformer Engine on GPU)
    hf_weights  HF <-> Megatron weight loading / TP-gathered export
    logprobs    per-token log-probs and entropy from vocab-parallel logits
    batching    samples -> padded micro-batches
    optim       DDP wrapper, optimizer, LR scheduler
    checkpoint  atomic save / load of model, optimizer, scheduler, RNG
    checkpoint_layout  the checkpoint files, folders and marker on disk (no torch)
    settings    TrainerSettings (plain values; no torch, no Megatron)
    trainer     MegatronTrainer, LossFn (TrainerSettings re-exported)
    testing     tiny models, toy data and multi-process helpers for tests

Importing this package does not import megatron-core; the names below load lazily. The modules import
megatron-core inside the functions that use it, after `apply_cpu_compat`, so that a process that only
reads or writes checkpoint files (the driver, the checks before a run) never loads it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "apply_cpu_compat": "cpu_compat",
    "ModelArch": "relax.formats.model_arch",
    "to_transformer_config": "transformer_config",
    "init_distributed": "parallel",
    "init_model_parallel": "parallel",
    "destroy": "parallel",
    "build_gpt_model": "model",
    "load_hf_weights": "hf_weights",
    "export_hf_weights": "hf_weights",
    "load_hf_checkpoint_dir": "hf_weights",
    "token_logprobs": "logprobs",
    "MegatronTrainer": "trainer",
    "TrainerSettings": "settings",
    "LossFn": "trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        where = _EXPORTS[name]
        module = importlib.import_module(where if "." in where else f"{__name__}.{where}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
