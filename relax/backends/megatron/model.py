"""Build a Megatron `GPTModel` for a `ModelArch`.

The local (pure PyTorch) layer spec is used on CPU; the Transformer Engine spec
when CUDA and `transformer_engine` are both available (or when asked).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Optional

import torch

from relax.formats.model_arch import ModelArch
from relax.backends.megatron.context_parallel import with_cp_attention
from relax.backends.megatron.cpu_compat import apply_cpu_compat, compute_device
from relax.backends.megatron.layernorm1p import zero_centered_block_spec
from relax.backends.megatron.megatron_options import call_provider
from relax.backends.megatron.rope import apply_llama3_rope_parameters
from relax.backends.megatron.sequence_parallel import block_spec

__all__ = ["build_gpt_model", "te_available", "layer_spec", "ValueHead", "is_value_head_param", "weights_checksum"]


def te_available() -> bool:
    """True when Transformer Engine can be used (CUDA present and the package importable)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def layer_spec(arch: ModelArch, use_te: bool, grouped_gemm: bool = False):
    """The transformer-layer spec for `arch` (TE or local; `grouped_gemm`: TE's grouped GEMM for the experts)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from relax.backends.megatron.post_norm import with_post_norms  # imports megatron-core, as the lines above

    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=arch.num_experts, moe_grouped_gemm=grouped_gemm, qk_layernorm=arch.qk_layernorm
        )
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=arch.num_experts,
            moe_grouped_gemm=False,
            qk_layernorm=arch.qk_layernorm,
            normalization=arch.normalization,
        )
    if arch.post_self_attn_layernorm:  # GLM4 (ModelArch keeps the two post-sublayer norms together)
        spec = with_post_norms(spec, _te_norm() if use_te else spec.submodules.input_layernorm)
    return spec


def _te_norm():
    """Transformer Engine's standalone norm (its layer spec fuses the other norms into the next linear layer)."""
    from megatron.core.extensions.transformer_engine import TENorm

    return TENorm


class ValueHead(torch.nn.Module):
    """Scalar value per position, in place of a GPTModel's LM head (critic models).

    Called like Megatron's output layer: `head(hidden [s, b, h], weight=None, runtime_gather_output=None)
    -> (values [s, b, 1], None)`, so `GPTModel.forward` returns values `[b, s, 1]` where it returns logits.
    The head is replicated (not split) over tensor-parallel ranks: the final hidden states are complete
    on every rank without sequence parallelism, so its gradients agree across ranks without a reduction;
    Megatron's grad-norm counts it once (it is a tensor-parallel duplicate). Initialised from `seed`
    (identically on every rank): weight ~ N(0, std^2), bias 0.
    """

    def __init__(self, hidden_size: int, *, std: float = 0.02, seed: int = 0,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        gen = torch.Generator().manual_seed(int(seed))
        self.value = torch.nn.Linear(hidden_size, 1, bias=True, dtype=params_dtype)
        with torch.no_grad():
            self.value.weight.copy_(torch.randn(1, hidden_size, generator=gen) * std)
            self.value.bias.zero_()
        for param in self.value.parameters():
            param.relax_value_head = True  # not an HF tensor: skipped by the HF loader/exporter
        self.sequence_parallel = False  # read by GPTModel's inference path

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        return self.value(hidden_states), None


def is_value_head_param(param: torch.Tensor) -> bool:
    return bool(getattr(param, "relax_value_head", False))


def build_gpt_model(
    arch: ModelArch,
    transformer_config,
    use_te: Optional[bool] = None,
    *,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    value_head: bool = False,
    value_head_seed: int = 0,
    custom_spec: Any = None,
    provider: Optional[Callable] = None,
    lora: Any = None,
):
    """A `GPTModel` for this rank's pipeline stage, on the compute device.

    `custom_spec` (--spec) replaces the transformer-layer spec; `provider` (--custom-model-provider-path)
    builds the model instead (relax.backends.megatron.megatron_options.call_provider says how it is called).

    `use_te=None` picks Transformer Engine when `te_available()`. With the
    config's `use_cpu_initialization` parameters are initialised on the CPU
    (identically for any TP size) and then moved to the compute device.

    `lora` (a `relax.backends.megatron.lora.LoraSettings`) adds adapters to the targeted linears and freezes the
    rest (relax.backends.megatron.lora.add_adapters).

    `value_head=True` builds a critic: untied embeddings, and the last stage's LM head replaced by a
    `ValueHead` (the model returns values [b, s, 1] instead of logits).
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
    spec = custom_spec or layer_spec(arch, use_te, grouped_gemm=bool(transformer_config.moe_grouped_gemm))
    if transformer_config.context_parallel_size > 1 and not use_te:  # TE's attention does CP itself
        spec = with_cp_attention(spec)
    block = spec
    if transformer_config.layernorm_zero_centered_gamma and not use_te:  # Nemotron: TE's norms compute it themselves
        block = zero_centered_block_spec(spec, transformer_config, vp_stage)
    elif transformer_config.sequence_parallel and not use_te:
        block = block_spec(spec, transformer_config, vp_stage)
    model = call_provider(provider, config=transformer_config, arch=arch, pre_process=pre_process,
                          post_process=post_process, vp_stage=vp_stage) if provider is not None else GPTModel(
        config=transformer_config,
        transformer_layer_spec=block,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not arch.untie_embeddings_and_output_weights and not value_head,
        position_embedding_type="rope",
        rotary_percent=arch.rotary_percent,
        rotary_base=arch.rotary_base,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
    apply_llama3_rope_parameters(model, arch)  # Megatron fixes three of llama3 scaling's four parameters
    if value_head:
        if transformer_config.sequence_parallel:
            raise NotImplementedError("a value head with sequence parallelism is not supported yet")
        if post_process:
            model.output_layer = ValueHead(arch.hidden_size, std=transformer_config.init_method_std,
                                           seed=value_head_seed, params_dtype=transformer_config.params_dtype)
    if lora is not None:
        from relax.backends.megatron.lora import add_adapters

        add_adapters(model, lora)
    return model.to(compute_device())


def weights_checksum(model: torch.nn.Module) -> float:
    """Sum of |w| over a model's parameters, in float64: a cheap check that two copies hold the same weights."""
    with torch.no_grad():
        return float(sum(p.double().abs().sum() for p in model.parameters()))
