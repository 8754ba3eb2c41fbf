"""Build a Megatron `GPTModel` for a `ModelArch`.

The local (pure PyTorch) layer spec is used on CPU; the Transformer Engine spec
when CUDA and `transformer_engine` are both available (or when asked).
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from relax.backends.megatron.arch import ModelArch
from relax.backends.megatron.cpu_compat import apply_cpu_compat, compute_device

__all__ = ["build_gpt_model", "te_available", "layer_spec"]


def te_available() -> bool:
    """True when Transformer Engine can be used (CUDA present and the package importable)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def layer_spec(arch: ModelArch, use_te: bool):
    """The transformer-layer spec for `arch` (TE or local)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=arch.num_experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_layernorm
        )
    return get_gpt_layer_local_spec(
        num_experts=arch.num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=arch.qk_layernorm,
        normalization=arch.normalization,
    )


def build_gpt_model(
    arch: ModelArch,
    transformer_config,
    use_te: Optional[bool] = None,
    *,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    vp_stage: Optional[int] = None,
):
    """A `GPTModel` for this rank's pipeline stage, on the compute device.

    `use_te=None` picks Transformer Engine when `te_available()`. With the
    config's `use_cpu_initialization` parameters are initialised on the CPU
    (identically for any TP size) and then moved to the compute device.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    apply_cpu_compat()
    if use_te is None:
        use_te = te_available()
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = GPTModel(
        config=transformer_config,
        transformer_layer_spec=layer_spec(arch, use_te),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not arch.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_percent=arch.rotary_percent,
        rotary_base=arch.rotary_base,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
    return model.to(compute_device())
