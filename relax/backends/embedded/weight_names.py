"""Checkpoint-format names for parameters that transformers stores fused in memory.

transformers 5 keeps a MoE layer's experts as 3-D tensors (`...mlp.experts.gate_up_proj` [E, 2I, H] and
`...mlp.experts.down_proj` [E, H, I]), while checkpoints and the trainer's export (relax.backends.megatron.
hf_weights) name every expert's matrices (`...mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H],
`down_proj` [H, I]). The engine accepts both: each checkpoint name maps to a view into the fused tensor, so a
weight update writes straight into the parameter.
"""

from __future__ import annotations

import torch


def expert_aliases(name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint names -> views of a fused expert parameter (empty for any other parameter)."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".experts") or param.dim() != 3:
        return {}
    out: dict[str, torch.Tensor] = {}
    if leaf == "gate_up_proj":
        half = param.shape[1] // 2
        for e in range(param.shape[0]):
            out[f"{prefix}.{e}.gate_proj.weight"] = param[e, :half]
            out[f"{prefix}.{e}.up_proj.weight"] = param[e, half:]
    elif leaf == "down_proj":
        for e in range(param.shape[0]):
            out[f"{prefix}.{e}.down_proj.weight"] = param[e]
    return out
