"""Sequence parallelism with Megatron's local (non-Transformer-Engine) layer spec, as used on CPU.

Under sequence parallelism each tensor-parallel rank holds a slice of the sequence between the linear layers,
so the norms there see only that slice and their weights get partial gradients. Megatron's torch norm
(`WrappedTorchNorm`) refuses the setting; Transformer Engine's and Apex's norms instead mark their weights
`sequence_parallel`, and `finalize_model_grads` then sums those gradients over the tensor-parallel group.
`SequenceParallelTorchNorm` is torch's norm with that mark, and `block_spec` puts it in every norm slot of a
layer spec and in the block's final norm.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build


class SequenceParallelTorchNorm:
    """torch's LayerNorm / RMSNorm (per `config.normalization`) whose parameters are marked `sequence_parallel`.
    Built the way Megatron builds a norm: `build_module(spec, config=..., hidden_size=..., eps=...)`."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError("zero-centered gamma, persistent and memory-efficient norms need Transformer Engine")
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization {config.normalization!r} is not built with sequence parallelism")
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def swap_norms(spec: Any, norm: Any) -> Any:
    """A copy of `spec` with every `WrappedTorchNorm` slot (at any depth) holding `norm`."""
    if spec is WrappedTorchNorm:
        return norm
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=swap_norms(spec.submodules, norm))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: swap_norms(getattr(spec, f.name), norm) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    return spec


def norm_block_spec(layer: ModuleSpec, config: Any, norm: Any, vp_stage: Optional[int] = None
                    ) -> TransformerBlockSubmodules:
    """The transformer block of this pipeline stage for a local `layer` spec with `norm` in every norm slot and as
    the block's final norm."""
    layers = [swap_norms(layer, norm)] * get_num_layers_to_build(config, vp_stage)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm)


def block_spec(layer: ModuleSpec, config: Any, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """The transformer block of this pipeline stage for a local `layer` spec under sequence parallelism."""
    return norm_block_spec(layer, config, SequenceParallelTorchNorm, vp_stage)
