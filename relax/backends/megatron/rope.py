"""Llama 3 RoPE scaling with the HF config's parameters in Megatron-core's rotary embedding.

megatron-core 0.16.1's `RotaryEmbedding` applies llama3 scaling (GPTModel's `rope_scaling` / `rope_scaling_factor`)
with low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings 8192: its `_apply_scaling` takes the
four parameters, but `__init__` passes only the factor. transformers (`_compute_llama3_parameters`) and so the
rollout engines read all four from the HF config's rope_scaling. A model whose config states other values would
train on other frequencies than the engines serve, so once GPTModel is built its inverse frequencies are computed
again, by Megatron's own `_apply_scaling` with the HF config's four values (`ModelArch.rope_*`).
"""

from __future__ import annotations

from typing import Any

import torch

from relax.formats.model_arch import ModelArch

__all__ = ["apply_llama3_rope_parameters", "llama3_inv_freq"]


def llama3_inv_freq(rotary: Any, arch: ModelArch, dim: int) -> torch.Tensor:
    """The inverse frequencies of a `dim`-wide rotary embedding under `arch`'s llama3 scaling, computed as
    Megatron computes them (its base frequencies, then its `_apply_scaling`) with the HF config's parameters."""
    device = rotary.inv_freq.device
    base = 1.0 / (arch.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    return rotary._apply_scaling(base, factor=arch.rope_scaling_factor, low_freq_factor=arch.rope_low_freq_factor,
                                 high_freq_factor=arch.rope_high_freq_factor,
                                 original_max_position_embeddings=arch.rope_original_max_position_embeddings)


def apply_llama3_rope_parameters(model: torch.nn.Module, arch: ModelArch) -> None:
    """Give every rotary embedding of `model` (one GPTModel chunk, built with rope_scaling) the HF config's llama3
    parameters. Call it right after the model is built: `RotaryEmbedding.forward` caches what it computes."""
    if not arch.llama3_rope_off_megatron():
        return  # Megatron's fixed values are the config's: the embedding is right as built
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    dim = int(arch.kv_channels * arch.rotary_percent) if arch.rotary_percent < 1.0 else arch.kv_channels
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = llama3_inv_freq(module, arch, dim)
