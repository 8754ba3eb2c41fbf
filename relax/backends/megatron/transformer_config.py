"""A Megatron `TransformerConfig` for a `ModelArch` (relax.formats.model_arch) under a parallel layout and
precision: the one place the trainer, the reference and the tests build it."""

from __future__ import annotations

from typing import Any, Optional

from megatron.core.activations import squared_relu
from megatron.core.transformer import TransformerConfig

from relax.formats.model_arch import ModelArch


def to_transformer_config(
    arch: ModelArch,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    params_dtype: Any = None,  # a torch.dtype; float32 when None
    bf16: bool = False,
    fp16: bool = False,
    sequence_parallel: bool = False,
    perform_initialization: bool = True,
    use_cpu_initialization: bool = True,
    init_method_std: float = 0.02,
    recompute_granularity: Optional[str] = None,
    deterministic_mode: bool = False,
    **overrides: Any,
):
    """A Megatron `TransformerConfig` for `arch` under the given parallel layout.

    Dropout is off unless `overrides` set `hidden_dropout` / `attention_dropout` (RL post-training trains
    without it); fusions that need CUDA kernels are off; `overrides` are passed to `TransformerConfig` last
    (recompute, dropout and attention backend come that way: relax.backends.megatron.layer_options);
    `params_dtype` is float32 unless given (or set by `bf16`/`fp16`). With
    `use_cpu_initialization` the random init is computed unsplit on the CPU, so
    it is identical for every TP size (slow for large models on GPU).
    """
    import torch

    if params_dtype is None:
        params_dtype = torch.float32
    if bf16 and fp16:
        raise ValueError("bf16 and fp16 are exclusive")
    if arch.vocab_size % tp:
        raise ValueError(
            f"padded vocab_size {arch.vocab_size} is not divisible by tp={tp}; "
            "use arch.with_vocab_multiple(tp)"
        )
    if bf16:
        params_dtype = torch.bfloat16
    elif fp16:
        params_dtype = torch.float16
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        normalization=arch.normalization,
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=arch.swiglu,
        activation_func=squared_relu if arch.squared_relu else torch.nn.functional.silu,
        layernorm_zero_centered_gamma=arch.layernorm_zero_centered_gamma,
        add_bias_linear=arch.add_bias_linear,
        add_qkv_bias=arch.add_qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        rotary_interleaved=arch.rotary_interleaved,  # the fraction rotated is GPTModel's rotary_percent
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        fp16=fp16,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=perform_initialization,
        init_method_std=init_method_std,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        variable_seq_lengths=pp > 1,  # micro-batches are padded to their own longest sample
        moe_token_dispatcher_type="alltoall",  # the only one allowing variable lengths
        deterministic_mode=deterministic_mode,
        recompute_granularity=recompute_granularity,
    )
    if recompute_granularity == "full":  # every layer, one at a time, unless `overrides` say otherwise
        kwargs.update(recompute_method="uniform", recompute_num_layers=1)
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_router_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_router_pre_softmax=not arch.moe_norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            # Qwen2-MoE: megatron-core's SharedExpertMLP computes HF's sigmoid(x @ gate^T) * shared_mlp(x)
            moe_shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=arch.moe_shared_expert_gate,
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
