"""Nemotron's zero-centred LayerNorm ("layernorm1p") in a Megatron-core model built with the local layer spec.

Nemotron (transformers' `NemotronLayerNorm1P`) stores each LayerNorm's scale zero-centred and computes
`layer_norm(x, weight + 1, bias, eps)`. Megatron-core's name for it is `layernorm_zero_centered_gamma`
(--apply-layernorm-1p); Transformer Engine's and Apex's norms compute it, but the torch norm of the local (CPU) layer
spec (`WrappedTorchNorm`) refuses it, as does the sequence-parallel torch norm of
relax.backends.megatron.sequence_parallel. `ZeroCenteredLayerNorm` is torch's LayerNorm computing with weight + 1
(the weight stored as HF stores it, so checkpoints copy as they are); under sequence parallelism its parameters are
marked `sequence_parallel` (each rank normalises its slice of the sequence, so Megatron sums their gradients over the
tensor-parallel group, as for Transformer Engine's norms). `zero_centered_block_spec` puts it in every norm slot of a
local layer spec and in the block's final norm.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from relax.backends.megatron.sequence_parallel import norm_block_spec

__all__ = ["ZeroCenteredLayerNorm", "zero_centered_block_spec"]


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm with the scale stored as gamma - 1 (HF's NemotronLayerNorm1P, Megatron's zero-centred
    gamma). Built the way Megatron builds a norm: `build_module(spec, config=..., hidden_size=..., eps=...)`."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.normalization != "LayerNorm" or not config.layernorm_zero_centered_gamma:
            raise ValueError("ZeroCenteredLayerNorm is the LayerNorm of --apply-layernorm-1p")
        super().__init__(hidden_size, eps=eps)
        with torch.no_grad():
            self.weight.zero_()  # gamma 1 at initialisation, as Megatron initialises zero-centred norms
        for param in self.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


def zero_centered_block_spec(layer: ModuleSpec, config: Any, vp_stage: Optional[int] = None
                             ) -> TransformerBlockSubmodules:
    """The transformer block of this pipeline stage for a local `layer` spec with zero-centred LayerNorms (with or
    without sequence parallelism)."""
    return norm_block_spec(layer, config, ZeroCenteredLayerNorm, vp_stage)
