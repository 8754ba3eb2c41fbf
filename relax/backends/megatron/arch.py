"""Model architecture: what an HF config says, in the terms Megatron-core needs.

`ModelArch` is a frozen, hashable description of a decoder-only transformer
(Llama, Qwen2, Qwen3 dense and Qwen3-MoE). `to_transformer_config` turns it plus
the parallel layout and precision into a Megatron `TransformerConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["ModelArch", "to_transformer_config", "pad_vocab_size"]

_SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    """Round `vocab_size` up to a multiple of `multiple`."""
    if multiple <= 1:
        return vocab_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def _cfg(hf_config: Any, name: str, default: Any = None) -> Any:
    if isinstance(hf_config, dict):
        return hf_config.get(name, default)
    return getattr(hf_config, name, default)


def _rope(hf_config: Any) -> tuple[float, Optional[float]]:
    """(rotary_base, llama3 scaling factor or None) from either HF config style."""
    params = _cfg(hf_config, "rope_parameters") or _cfg(hf_config, "rope_scaling") or {}
    theta = _cfg(hf_config, "rope_theta") or params.get("rope_theta") or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if float(params.get(key, value)) != value:
                raise NotImplementedError(
                    f"llama3 RoPE with {key}={params.get(key)} (Megatron fixes it at {value})"
                )
        return float(theta), float(params["factor"])
    raise NotImplementedError(f"RoPE type {rope_type!r} is not supported")


@dataclass(frozen=True)
class ModelArch:
    """Shape of a decoder-only transformer, independent of parallelism."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int  # padded; Megatron's embedding and output layer have this many rows
    max_position_embeddings: int
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling_factor: Optional[float] = None  # llama3-style scaling when set
    norm_epsilon: float = 1e-6
    normalization: str = "RMSNorm"
    swiglu: bool = True
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    untie_embeddings_and_output_weights: bool = True
    hf_family: str = "llama"
    hf_vocab_size: Optional[int] = None  # the real vocabulary; rows past it are padding
    # Mixture of experts (Qwen3-MoE); num_experts None means dense.
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.hf_vocab_size is None:
            object.__setattr__(self, "hf_vocab_size", self.vocab_size)
        if self.hf_vocab_size > self.vocab_size:
            raise ValueError("hf_vocab_size exceeds the padded vocab_size")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError("num_attention_heads must be a multiple of num_query_groups")
        if self.hf_family not in _SUPPORTED_FAMILIES:
            raise ValueError(f"hf_family {self.hf_family!r} not in {_SUPPORTED_FAMILIES}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def with_vocab_multiple(self, multiple: int) -> "ModelArch":
        """The same model with the vocabulary padded to a multiple of `multiple`."""
        return dataclasses.replace(
            self, vocab_size=pad_vocab_size(self.hf_vocab_size, multiple)
        )

    @classmethod
    def from_hf_config(cls, hf_config: Any, *, vocab_multiple: int = 1) -> "ModelArch":
        """Build from a transformers config (object or dict) of Llama/Qwen2/Qwen3(-MoE)."""
        model_type = _cfg(hf_config, "model_type")
        if model_type not in _SUPPORTED_FAMILIES:
            raise NotImplementedError(f"model_type {model_type!r} is not supported")
        hidden = _cfg(hf_config, "hidden_size")
        heads = _cfg(hf_config, "num_attention_heads")
        act = _cfg(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act {act!r} (only silu/SwiGLU)")
        if _cfg(hf_config, "use_sliding_window", False):
            raise NotImplementedError("sliding-window attention is not supported")
        if _cfg(hf_config, "mlp_bias", False):
            raise NotImplementedError("MLP biases are not supported")
        base, scaling = _rope(hf_config)
        head_dim = _cfg(hf_config, "head_dim") or hidden // heads
        vocab = _cfg(hf_config, "vocab_size")
        qkv_bias = model_type == "qwen2" or bool(_cfg(hf_config, "attention_bias", False))
        moe: dict[str, Any] = {}
        if model_type == "qwen3_moe":
            if _cfg(hf_config, "mlp_only_layers") or _cfg(hf_config, "decoder_sparse_step", 1) != 1:
                raise NotImplementedError("Qwen3-MoE with dense layers mixed in")
            moe = dict(
                num_experts=_cfg(hf_config, "num_experts"),
                moe_router_topk=_cfg(hf_config, "num_experts_per_tok"),
                moe_ffn_hidden_size=_cfg(hf_config, "moe_intermediate_size"),
                moe_norm_topk_prob=bool(_cfg(hf_config, "norm_topk_prob", True)),
            )
        return cls(
            num_layers=_cfg(hf_config, "num_hidden_layers"),
            hidden_size=hidden,
            ffn_hidden_size=_cfg(hf_config, "intermediate_size"),
            num_attention_heads=heads,
            num_query_groups=_cfg(hf_config, "num_key_value_heads") or heads,
            kv_channels=head_dim,
            vocab_size=pad_vocab_size(vocab, vocab_multiple),
            hf_vocab_size=vocab,
            max_position_embeddings=_cfg(hf_config, "max_position_embeddings"),
            rotary_base=base,
            rope_scaling_factor=scaling,
            norm_epsilon=float(_cfg(hf_config, "rms_norm_eps", 1e-6)),
            normalization="RMSNorm",
            swiglu=True,
            add_bias_linear=False,
            add_qkv_bias=qkv_bias,
            qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
            untie_embeddings_and_output_weights=not _cfg(hf_config, "tie_word_embeddings", False),
            hf_family=model_type,
            **moe,
        )


def to_transformer_config(
    arch: ModelArch,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    params_dtype: torch.dtype = torch.float32,
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

    Dropout is off (RL post-training); fusions that need CUDA kernels are off;
    `overrides` are passed to `TransformerConfig` last. With
    `use_cpu_initialization` the random init is computed unsplit on the CPU, so
    it is identical for every TP size (slow for large models on GPU).
    """
    from megatron.core.transformer import TransformerConfig

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
        activation_func=torch.nn.functional.silu,
        add_bias_linear=arch.add_bias_linear,
        add_qkv_bias=arch.add_qkv_bias,
        qk_layernorm=arch.qk_layernorm,
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
    if recompute_granularity == "full":
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
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
