"""Model architecture: what an HF config or Megatron's architecture flags say, in the terms Megatron-core needs.

`ModelArch` is a frozen, hashable description of a decoder-only transformer
(Llama, Qwen2, Qwen3 dense, Qwen3-MoE, Qwen2-MoE, GLM4 dense and Nemotron). It is built from an HF config
(`from_hf_config`) or from Megatron's architecture flags (`from_flags`), and
`to_flags` states it back as those flags. `relax.backends.megatron.transformer_config` turns it plus
the parallel layout and precision into a Megatron `TransformerConfig`.

Pure rules, no torch or megatron-core: the checks before a run (relax.config.rules_arch) read this module and
must stay fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = ["ARCH_FLAGS", "BUILDABLE_FLAGS", "MEGATRON_LLAMA3_ROPE", "SIZE_FLAGS", "ModelArch", "arch_for_run",
           "pad_vocab_size", "glm4_flag_problems", "moe_flag_problems",
           "nemotron_flag_problems"]

_SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "glm4", "nemotron")

# Megatron's architecture flags (argparse dest -> (flag, where an HF config states the same fact)). These are
# the flags of the Megatron parser that decide the shape of the model Relax builds; `ModelArch.to_flags` gives
# their values for a model, `ModelArch.from_flags` builds a model from them. It includes the flags of features
# the families above do not have (other activations, zero-centred norms, MLA, shared experts, grouped routing,
# ...): `_ABSENT_FEATURES` holds the value that leaves each off.
ARCH_FLAGS: dict[str, tuple[str, str]] = {
    "num_layers": ("--num-layers", "num_hidden_layers"),
    "hidden_size": ("--hidden-size", "hidden_size"),
    "ffn_hidden_size": ("--ffn-hidden-size", "intermediate_size"),
    "num_attention_heads": ("--num-attention-heads", "num_attention_heads"),
    "group_query_attention": ("--group-query-attention", "num_key_value_heads"),
    "num_query_groups": ("--num-query-groups", "num_key_value_heads"),
    "kv_channels": ("--kv-channels", "head_dim, else hidden_size / num_attention_heads"),
    "swiglu": ("--swiglu", "hidden_act silu, gated MLP"),
    "squared_relu": ("--squared-relu", "hidden_act relu2, a non-gated MLP: model_type nemotron"),
    "openai_gelu": ("--openai-gelu", "hidden_act"),
    "quick_geglu": ("--quick-geglu", "hidden_act"),
    "normalization": ("--normalization", "LayerNorm in model_type nemotron, RMSNorm in the other families"),
    "layernorm_epsilon": ("--norm-epsilon", "rms_norm_eps, norm_eps in model_type nemotron"),
    "layernorm_zero_centered_gamma": ("--apply-layernorm-1p", "model_type nemotron (NemotronLayerNorm1P: weight + 1)"),
    "apply_residual_connection_post_layernorm": ("--apply-residual-connection-post-layernorm", "pre-norm models"),
    "qk_layernorm": ("--qk-layernorm", "model_type qwen3 / qwen3_moe (q_norm, k_norm)"),
    "qk_l2_norm": ("--qk-l2-norm", "the supported Llama/Qwen models have none"),
    "attention_output_gate": ("--attention-output-gate", "the supported Llama/Qwen models have none"),
    "multi_latent_attention": ("--multi-latent-attention", "the supported Llama/Qwen models have none"),
    "position_embedding_type": ("--position-embedding-type", "RoPE"),
    "use_rotary_position_embeddings": ("--use-rotary-position-embeddings", "RoPE"),
    "add_position_embedding": ("--no-position-embedding", "no learned position table (RoPE)"),
    "rotary_base": ("--rotary-base", "rope_theta"),
    "rotary_percent": ("--rotary-percent", "partial_rotary_factor: 0.5 in GLM4 and Nemotron, the whole head "
                                           "elsewhere"),
    "rotary_interleaved": ("--rotary-interleaved", "model_type glm4 rotates interleaved pairs, Llama/Qwen "
                                                   "models the two halves of the head"),
    "rotary_seq_len_interpolation_factor": ("--rotary-seq-len-interpolation-factor", "rope_scaling"),
    "use_rope_scaling": ("--use-rope-scaling", "rope_scaling of rope_type llama3"),
    "rope_scaling_factor": ("--rope-scaling-factor", "rope_scaling.factor"),
    "max_position_embeddings": ("--max-position-embeddings", "max_position_embeddings"),
    "untie_embeddings_and_output_weights": ("--untie-embeddings-and-output-weights", "tie_word_embeddings"),
    "add_bias_linear": ("--disable-bias-linear", "mlp_bias; Llama/Qwen models have no linear biases"),
    "add_qkv_bias": ("--add-qkv-bias", "QKV biases: model_type qwen2, or attention_bias"),
    "post_self_attn_layernorm": ("--post-self-attn-layernorm", "model_type glm4 (post_self_attn_layernorm)"),
    "post_mlp_layernorm": ("--post-mlp-layernorm", "model_type glm4 (post_mlp_layernorm)"),
    "vocab_size": ("--vocab-size", "vocab_size"),
    "num_experts": ("--num-experts", "num_experts"),
    "moe_ffn_hidden_size": ("--moe-ffn-hidden-size", "moe_intermediate_size"),
    "moe_router_topk": ("--moe-router-topk", "num_experts_per_tok"),
    "moe_layer_freq": ("--moe-layer-freq", "every layer MoE (decoder_sparse_step 1, no mlp_only_layers)"),
    "moe_router_pre_softmax": ("--moe-router-pre-softmax", "norm_topk_prob: true means top-k, then softmax"),
    "moe_router_score_function": ("--moe-router-score-function", "softmax routing"),
    "moe_router_topk_scaling_factor": ("--moe-router-topk-scaling-factor", "no routing-weight scale"),
    "moe_router_num_groups": ("--moe-router-num-groups", "no grouped routing"),
    "moe_router_group_topk": ("--moe-router-group-topk", "no grouped routing"),
    "moe_router_enable_expert_bias": ("--moe-router-enable-expert-bias", "no expert bias"),
    "moe_shared_expert_intermediate_size": ("--moe-shared-expert-intermediate-size",
                                            "shared_expert_intermediate_size: model_type qwen2_moe has a shared "
                                            "expert, the other families none"),
    "moe_shared_expert_gate": ("--moe-shared-expert-gate", "model_type qwen2_moe (shared_expert_gate)"),
}

# Megatron flags about the model's size that are no single fact of an HF config (dest -> flag): checked against
# the HF config before a run (relax.config.rules_arch) and used as Megatron uses them (`arch_for_run`).
SIZE_FLAGS: dict[str, str] = {
    "seq_length": "--seq-length",
    "padded_vocab_size": "--padded-vocab-size",
    "make_vocab_size_divisible_by": "--make-vocab-size-divisible-by",
}

# Flags of features the supported families do not have, with the value that leaves the feature off.
_ABSENT_FEATURES: dict[str, Any] = {
    "openai_gelu": False, "quick_geglu": False,
    "apply_residual_connection_post_layernorm": False, "qk_l2_norm": False, "attention_output_gate": False,
    "multi_latent_attention": False, "rotary_seq_len_interpolation_factor": None,
    "moe_router_score_function": "softmax", "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
    "moe_router_group_topk": None, "moe_router_enable_expert_bias": False,
}

# The architecture flags that can take a value other than Megatron's default in a model Relax builds (the others
# describe features no supported family has).
BUILDABLE_FLAGS: frozenset[str] = frozenset(ARCH_FLAGS) - frozenset(_ABSENT_FEATURES)

# GLM4's features, which no other supported family has (its HF modelling code, Glm4DecoderLayer/Glm4Attention):
# RoPE on the first `partial_rotary_factor` of each head, on interleaved pairs (dims 2i, 2i+1) instead of the two
# halves, and an RMSNorm on the attention's and on the MLP's output before each residual add.
_GLM4_ONLY = ("rotary_interleaved", "post_self_attn_layernorm", "post_mlp_layernorm")

# Nemotron's features, which no other supported family has (its HF modelling code, NemotronMLP/NemotronLayerNorm1P):
# a non-gated MLP with squared ReLU (relu2) and LayerNorms (with bias) whose scale is stored as gamma - 1. Its partial
# RoPE rotates the two halves of the first `partial_rotary_factor` of each head (Megatron's non-interleaved RoPE).
_NEMOTRON_ONLY = ("squared_relu", "layernorm_zero_centered_gamma")
_NEMOTRON_HINT = "--squared-relu --apply-layernorm-1p --normalization LayerNorm"


def megatron_default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron's --ffn-hidden-size when unset: 4 x hidden, or 2/3 of it rounded down to 64 with SwiGLU."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    """Round `vocab_size` up to a multiple of `multiple`."""
    if multiple <= 1:
        return vocab_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def _cfg(hf_config: Any, name: str, default: Any = None) -> Any:
    if isinstance(hf_config, dict):
        return hf_config.get(name, default)
    return getattr(hf_config, name, default)


def _partial_rotary_factor(hf_config: Any, model_type: str) -> float:
    """The fraction of each head that RoPE rotates: `partial_rotary_factor` (in rope_parameters in transformers 5,
    top-level before), defaulting as transformers does (0.5 for GLM4 and Nemotron, the whole head elsewhere)."""
    params = _cfg(hf_config, "rope_parameters") or {}
    factor = params.get("partial_rotary_factor", _cfg(hf_config, "partial_rotary_factor"))
    return float(factor if factor is not None else 0.5 if model_type in ("glm4", "nemotron") else 1.0)


# The parameters of llama3 RoPE scaling besides its factor, as Megatron-core's RotaryEmbedding fixes them (its
# _apply_scaling defaults, which GPTModel never overrides: Llama 3.1's values). HF configs state them in rope_scaling
# (rope_parameters in transformers 5); the model is built with the HF config's (relax.backends.megatron.rope).
MEGATRON_LLAMA3_ROPE: dict[str, float] = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}


def _rope(hf_config: Any) -> tuple[float, Optional[float], tuple[float, float, int]]:
    """(rotary_base, llama3 scaling factor or None, its (low_freq_factor, high_freq_factor,
    original_max_position_embeddings)) from either HF config style. A missing original context length is
    max_position_embeddings, as transformers fills it in."""
    params = _cfg(hf_config, "rope_parameters") or _cfg(hf_config, "rope_scaling") or {}
    theta = _cfg(hf_config, "rope_theta") or params.get("rope_theta") or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    fixed = tuple(MEGATRON_LLAMA3_ROPE.values())
    if rope_type == "default":
        return float(theta), None, fixed
    if rope_type == "llama3":
        low = float(params.get("low_freq_factor", MEGATRON_LLAMA3_ROPE["low_freq_factor"]))
        high = float(params.get("high_freq_factor", MEGATRON_LLAMA3_ROPE["high_freq_factor"]))
        original = int(params.get("original_max_position_embeddings") or _cfg(hf_config, "max_position_embeddings"))
        if not 0 < low < high:  # the smoothing between the two divides by high - low
            raise NotImplementedError(f"llama3 RoPE with low_freq_factor {low} and high_freq_factor {high} "
                                      "(the low one must be positive and below the high one)")
        return float(theta), float(params["factor"]), (low, high, original)
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
    rotary_percent: float = 1.0  # the fraction of each head RoPE rotates (the first dims); GLM4's 0.5
    rotary_interleaved: bool = False  # RoPE on pairs (2i, 2i+1) (GLM4), not on the head's two halves
    rope_scaling_factor: Optional[float] = None  # llama3-style scaling when set
    # llama3 scaling's other parameters (HF rope_scaling); Megatron's flags cannot state them (MEGATRON_LLAMA3_ROPE)
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    norm_epsilon: float = 1e-6
    normalization: str = "RMSNorm"  # LayerNorm (with bias) in Nemotron
    swiglu: bool = True
    squared_relu: bool = False  # Nemotron's non-gated relu(x)^2 MLP (swiglu False)
    layernorm_zero_centered_gamma: bool = False  # Nemotron's LayerNorm1P: the scale is stored as gamma - 1
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    # GLM4's RMSNorms of the attention's and the MLP's output, before each residual add
    post_self_attn_layernorm: bool = False
    post_mlp_layernorm: bool = False
    untie_embeddings_and_output_weights: bool = True
    hf_family: str = "llama"
    hf_vocab_size: Optional[int] = None  # the real vocabulary; rows past it are padding
    # Mixture of experts (Qwen3-MoE, Qwen2-MoE); num_experts None means dense.
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_norm_topk_prob: bool = True
    # Qwen2-MoE's shared expert (a gated SiLU MLP every token goes through, added to the routed experts' output)
    # and its gate (sigmoid of a linear map of the hidden state, multiplied into the shared expert's output)
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        if self.hf_vocab_size is None:
            object.__setattr__(self, "hf_vocab_size", self.vocab_size)
        if self.hf_vocab_size > self.vocab_size:
            raise ValueError("hf_vocab_size exceeds the padded vocab_size")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError("num_attention_heads must be a multiple of num_query_groups")
        if self.hf_family not in _SUPPORTED_FAMILIES:
            raise ValueError(f"hf_family {self.hf_family!r} not in {_SUPPORTED_FAMILIES}")
        glm4 = (self.rotary_interleaved, self.post_self_attn_layernorm, self.post_mlp_layernorm)
        if (self.hf_family == "glm4") != any(glm4) or (any(glm4) and not all(glm4)) \
                or (self.rotary_interleaved and self.hf_family != "glm4"):
            # the HF export names the model by hf_family: only Glm4ForCausalLM computes these features
            raise ValueError("interleaved or partial RoPE and the post-sublayer norms make a glm4 model, "
                             "and a glm4 model has the three of them")
        shared = self.moe_shared_expert_intermediate_size is not None
        if (self.hf_family == "qwen2_moe") != shared or shared != self.moe_shared_expert_gate \
                or (shared and not self.is_moe):
            # Qwen2MoeSparseMoeBlock always has the gated shared expert; no other family's HF code has one
            raise ValueError("a shared expert and its gate make a qwen2_moe model (an MoE model), and a qwen2_moe "
                             "model has both")
        nemotron = (self.squared_relu, self.layernorm_zero_centered_gamma, self.normalization == "LayerNorm",
                    not self.swiglu)
        if (self.hf_family == "nemotron") != all(nemotron) or (any(nemotron) and not all(nemotron)):
            raise ValueError("a squared-ReLU non-gated MLP and zero-centred LayerNorms make a nemotron model, and a "
                             "nemotron model has both")
        if self.rotary_percent != 1.0 and self.hf_family not in ("glm4", "nemotron"):
            raise ValueError("only glm4 and nemotron models rotate part of the head")

    def llama3_rope_off_megatron(self) -> dict[str, tuple[float, float]]:
        """The llama3 scaling parameters of this model that Megatron's flags (--use-rope-scaling, which fixes them)
        would get wrong: HF name -> (this model's value, Megatron's). Empty without scaling."""
        if self.rope_scaling_factor is None:
            return {}
        ours = (self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_original_max_position_embeddings)
        return {name: (value, fixed) for (name, fixed), value in zip(MEGATRON_LLAMA3_ROPE.items(), ours)
                if float(value) != float(fixed)}

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
        """Build from a transformers config (object or dict) of Llama/Qwen2/Qwen3(-MoE)/Qwen2-MoE/GLM4/Nemotron."""
        model_type = _cfg(hf_config, "model_type")
        if model_type not in _SUPPORTED_FAMILIES:
            raise NotImplementedError(f"model_type {model_type!r} is not supported")
        hidden = _cfg(hf_config, "hidden_size")
        heads = _cfg(hf_config, "num_attention_heads")
        nemotron = model_type == "nemotron"
        want_act = "relu2" if nemotron else "silu"  # Nemotron: non-gated squared ReLU; the others: SwiGLU
        act = _cfg(hf_config, "hidden_act", want_act)
        if act != want_act:
            raise NotImplementedError(f"hidden_act {act!r} in a {model_type} model (only {want_act})")
        if nemotron and _cfg(hf_config, "attention_bias", False):
            raise NotImplementedError("nemotron with attention_bias (biases in q/k/v and o_proj)")
        if _cfg(hf_config, "use_sliding_window", False):
            raise NotImplementedError("sliding-window attention is not supported")
        if _cfg(hf_config, "mlp_bias", False):
            raise NotImplementedError("MLP biases are not supported")
        base, scaling, (low_freq, high_freq, original_positions) = _rope(hf_config)
        glm4 = model_type == "glm4"
        partial = _partial_rotary_factor(hf_config, model_type)
        if partial != 1.0 and not (glm4 or nemotron):  # the others' code rotates the whole head whatever the config
            raise NotImplementedError(f"partial_rotary_factor {partial} in a {model_type} model")
        head_dim = _cfg(hf_config, "head_dim") or hidden // heads
        vocab = _cfg(hf_config, "vocab_size")
        # Glm4Config's attention_bias defaults to True, the others' to False
        qkv_bias = model_type == "qwen2" or bool(_cfg(hf_config, "attention_bias", glm4))
        if model_type == "qwen2_moe":  # Qwen2MoeConfig names it qkv_bias (default True)
            qkv_bias = bool(_cfg(hf_config, "qkv_bias", True))
        moe = _hf_moe(hf_config, model_type)
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
            rotary_percent=partial,
            rotary_interleaved=glm4,
            rope_scaling_factor=scaling,
            rope_low_freq_factor=low_freq,
            rope_high_freq_factor=high_freq,
            rope_original_max_position_embeddings=original_positions,
            norm_epsilon=float(_cfg(hf_config, "norm_eps", 1e-5) if nemotron
                               else _cfg(hf_config, "rms_norm_eps", 1e-6)),
            normalization="LayerNorm" if nemotron else "RMSNorm",
            swiglu=not nemotron,
            squared_relu=nemotron,
            layernorm_zero_centered_gamma=nemotron,
            add_bias_linear=False,
            add_qkv_bias=qkv_bias,
            qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
            post_self_attn_layernorm=glm4,
            post_mlp_layernorm=glm4,
            untie_embeddings_and_output_weights=not _cfg(hf_config, "tie_word_embeddings", False),
            hf_family=model_type,
            **moe,
        )

    def to_flags(self) -> dict[str, Any]:
        """This model as Megatron's architecture flags (every dest of `ARCH_FLAGS`), the values with which
        Megatron would build the same model. MoE flags of a dense model are None."""
        moe = self.is_moe
        flags: dict[str, Any] = dict(_ABSENT_FEATURES)
        flags.update(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads,
            group_query_attention=self.num_query_groups != self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.kv_channels,
            swiglu=self.swiglu,
            squared_relu=self.squared_relu,
            layernorm_zero_centered_gamma=self.layernorm_zero_centered_gamma,
            normalization=self.normalization,
            layernorm_epsilon=self.norm_epsilon,
            qk_layernorm=self.qk_layernorm,
            position_embedding_type="rope",
            use_rotary_position_embeddings=True,
            add_position_embedding=False,
            rotary_base=self.rotary_base,
            rotary_percent=self.rotary_percent,
            rotary_interleaved=self.rotary_interleaved,
            post_self_attn_layernorm=self.post_self_attn_layernorm,
            post_mlp_layernorm=self.post_mlp_layernorm,
            use_rope_scaling=self.rope_scaling_factor is not None,
            rope_scaling_factor=self.rope_scaling_factor,
            max_position_embeddings=self.max_position_embeddings,
            untie_embeddings_and_output_weights=self.untie_embeddings_and_output_weights,
            add_bias_linear=self.add_bias_linear,
            add_qkv_bias=self.add_qkv_bias,
            vocab_size=self.hf_vocab_size,
            num_experts=self.num_experts,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size if moe else None,
            moe_router_topk=self.moe_router_topk if moe else None,
            moe_layer_freq=1 if moe else None,
            moe_router_pre_softmax=(not self.moe_norm_topk_prob) if moe else None,
            moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=self.moe_shared_expert_gate,
        )
        return flags

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any], *, vocab_multiple: int = 1) -> "ModelArch":
        """Build from Megatron's architecture flags (a mapping of dests, such as a run's `Config`), read as
        Megatron reads them: --ffn-hidden-size and --kv-channels default from --hidden-size, --num-query-groups
        counts only with --group-query-attention, --max-position-embeddings defaults to --seq-length.

        Only models that Relax can also export to Hugging Face (and so to the rollout engines) are built:
        Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, GLM4 and Nemotron shapes (Nemotron: --squared-relu with
        --apply-layernorm-1p and --normalization LayerNorm, in place of --swiglu and RMSNorm). An MoE model with
        --qk-layernorm is Qwen3-MoE;
        one without is Qwen2-MoE, which needs --moe-shared-expert-intermediate-size and --moe-shared-expert-gate.
        A GLM4 model is the one with --post-self-attn-layernorm
        and --post-mlp-layernorm; it also needs --rotary-interleaved (its HF modelling code rotates pairs), and
        --rotary-interleaved or a --rotary-percent below 1 need it (no other family's HF code has them).
        ValueError names every missing or unbuildable flag.
        """
        get = flags.get
        problems = [f"{ARCH_FLAGS[d][0]} is required" for d in ("num_layers", "hidden_size", "num_attention_heads")
                    if not get(d)]
        if not (get("vocab_size") or get("padded_vocab_size")):
            problems.append("--vocab-size (or --padded-vocab-size) is required")
        max_pos = get("max_position_embeddings") or get("seq_length")
        if not max_pos:
            problems.append("--max-position-embeddings (or --seq-length) is required")
        nemotron = bool(get("squared_relu") or get("layernorm_zero_centered_gamma"))
        if not get("swiglu") and not nemotron:
            problems.append("--swiglu is required (the supported models have a gated SiLU MLP, or Nemotron's "
                            f"squared ReLU: {_NEMOTRON_HINT})")
        if get("normalization", "LayerNorm") != "RMSNorm" and not nemotron:
            problems.append(f"--normalization {get('normalization', 'LayerNorm')}: the supported models use RMSNorm "
                            f"(Nemotron's zero-centred LayerNorm: {_NEMOTRON_HINT})")
        if not (get("use_rotary_position_embeddings") or get("position_embedding_type") == "rope"):
            problems.append("--position-embedding-type rope (or --use-rotary-position-embeddings) is required")
        if get("add_bias_linear", True):
            problems.append("--disable-bias-linear is required (the supported models have no linear biases)")
        problems += glm4_flag_problems(get) + moe_flag_problems(get) + nemotron_flag_problems(get)
        for dest, off in _ABSENT_FEATURES.items():
            if get(dest, off) != off:
                problems.append(f"{ARCH_FLAGS[dest][0]} {get(dest)}: not a feature of the supported models")
        experts = get("num_experts") or None
        freq = get("moe_layer_freq", 1)
        if experts and not (freq == 1 or (isinstance(freq, list) and all(f == 1 for f in freq))):
            problems.append(f"--moe-layer-freq {freq}: only all-MoE layers are supported")
        if problems:
            raise ValueError("cannot build the model from the architecture flags: " + "; ".join(problems))
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        ffn = get("ffn_hidden_size") or megatron_default_ffn_hidden_size(hidden, not nemotron)
        vocab = get("vocab_size") or get("padded_vocab_size")
        padded = get("padded_vocab_size") or pad_vocab_size(vocab, vocab_multiple)
        moe: dict[str, Any] = {}
        if experts:
            moe = dict(num_experts=experts, moe_router_topk=get("moe_router_topk") or 2,
                       moe_ffn_hidden_size=get("moe_ffn_hidden_size") or ffn,
                       moe_norm_topk_prob=not get("moe_router_pre_softmax"),
                       moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size") or None,
                       moe_shared_expert_gate=bool(get("moe_shared_expert_gate")))
        glm4 = bool(get("post_self_attn_layernorm"))
        family = ("qwen3_moe" if experts and get("qk_layernorm") else "qwen2_moe" if experts
                  else "qwen3" if get("qk_layernorm") else "glm4" if glm4 else "nemotron" if nemotron
                  else "qwen2" if get("add_qkv_bias") else "llama")
        return cls(
            num_layers=get("num_layers"),
            hidden_size=hidden,
            ffn_hidden_size=ffn,
            num_attention_heads=heads,
            num_query_groups=get("num_query_groups") if get("group_query_attention") else heads,
            kv_channels=get("kv_channels") or hidden // heads,
            vocab_size=padded,
            hf_vocab_size=vocab,
            max_position_embeddings=max_pos,
            rotary_base=float(get("rotary_base") or 10000),
            rotary_percent=float(get("rotary_percent") or 1.0),
            rotary_interleaved=bool(get("rotary_interleaved")),
            rope_scaling_factor=float(get("rope_scaling_factor") or 8.0) if get("use_rope_scaling") else None,
            norm_epsilon=float(get("layernorm_epsilon") or 1e-5),
            normalization="LayerNorm" if nemotron else "RMSNorm",
            swiglu=not nemotron,
            squared_relu=nemotron,
            layernorm_zero_centered_gamma=nemotron,
            add_bias_linear=False,
            add_qkv_bias=bool(get("add_qkv_bias")),
            qk_layernorm=bool(get("qk_layernorm")),
            post_self_attn_layernorm=glm4,
            post_mlp_layernorm=glm4,
            untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights")),
            hf_family=family,
            **moe,
        )


def _hf_moe(hf_config: Any, model_type: str) -> dict[str, Any]:
    """ModelArch's MoE fields of a qwen3_moe or qwen2_moe HF config (empty for a dense model). Qwen2-MoE's router
    leaves the top-k weights unnormalised by default (norm_topk_prob false), Qwen3-MoE's normalises them."""
    if model_type not in ("qwen3_moe", "qwen2_moe"):
        return {}
    if _cfg(hf_config, "mlp_only_layers") or _cfg(hf_config, "decoder_sparse_step", 1) != 1:
        raise NotImplementedError(f"{model_type} with dense layers mixed in")
    moe = dict(
        num_experts=_cfg(hf_config, "num_experts"),
        moe_router_topk=_cfg(hf_config, "num_experts_per_tok"),
        moe_ffn_hidden_size=_cfg(hf_config, "moe_intermediate_size"),
        moe_norm_topk_prob=bool(_cfg(hf_config, "norm_topk_prob", model_type == "qwen3_moe")),
    )
    if model_type == "qwen2_moe":
        shared = _cfg(hf_config, "shared_expert_intermediate_size")
        if not shared:
            raise NotImplementedError(f"qwen2_moe with shared_expert_intermediate_size {shared}")
        moe.update(moe_shared_expert_intermediate_size=int(shared), moe_shared_expert_gate=True)
    return moe


def moe_flag_problems(get, complete: bool = True) -> list[str]:
    """The MoE families' flags: an MoE model with --qk-layernorm is Qwen3-MoE (no shared expert), one without is
    Qwen2-MoE, whose HF modelling code (Qwen2MoeSparseMoeBlock) always has a shared expert with a sigmoid gate.
    `get`: a flag dest's value (`flags.get`); `complete`: the flags are the whole model (`ModelArch.from_flags`), so
    a Qwen2-MoE model missing its shared expert is a problem too (with an HF config the flags may be a part of it).
    Each problem names its flags."""
    experts = get("num_experts")
    shared, gate = get("moe_shared_expert_intermediate_size"), get("moe_shared_expert_gate")
    given = " ".join(ARCH_FLAGS[d][0] + ("" if d == "moe_shared_expert_gate" else f" {get(d)}")
                     for d in ("moe_shared_expert_intermediate_size", "moe_shared_expert_gate") if get(d))
    if not experts:
        return [f"{given} without --num-experts: a shared expert is part of an MoE layer"] if given else []
    if get("qk_layernorm"):
        return [f"{given} with --qk-layernorm: Qwen3-MoE models (the MoE family with --qk-layernorm) have no shared "
                "expert"] if given else []
    if complete and not (shared and gate):
        missing = " ".join(ARCH_FLAGS[d][0] for d in ("moe_shared_expert_intermediate_size", "moe_shared_expert_gate")
                           if not get(d))
        return [f"--num-experts without --qk-layernorm is a Qwen2-MoE model, which has a gated shared expert: "
                f"{missing} is required (or --qk-layernorm for Qwen3-MoE)"]
    return []


def nemotron_flag_problems(get) -> list[str]:
    """Nemotron's flags come together: --squared-relu (a non-gated relu(x)^2 MLP) and --apply-layernorm-1p with
    --normalization LayerNorm make the Nemotron family (HF's NemotronForCausalLM has all of them, no other family
    any); its --rotary-percent rotates the halves of part of each head. `get`: a flag dest's value (`flags.get`).
    Each problem names its flags."""
    given = [d for d in _NEMOTRON_ONLY if get(d)]
    if not given:
        return []
    shown = " ".join(ARCH_FLAGS[d][0] for d in given)
    others = [flag for dest, flag in (("swiglu", "--swiglu"), ("qk_layernorm", "--qk-layernorm"),
                                      ("num_experts", "--num-experts"), ("add_qkv_bias", "--add-qkv-bias"),
                                      *((d, ARCH_FLAGS[d][0]) for d in _GLM4_ONLY)) if get(dest)]
    problems = []
    if others:
        problems.append(f"{shown} with {' '.join(others)}: the Nemotron features with another family's (no "
                        "supported model has both)")
    missing = [ARCH_FLAGS[d][0] for d in _NEMOTRON_ONLY if d not in given]
    if get("normalization", "LayerNorm") != "LayerNorm":
        missing.append(f"--normalization LayerNorm (not {get('normalization')})")
    if missing:
        problems.append(f"{shown} without {' '.join(missing)}: Nemotron models (the only family with these features) "
                        "have all of them")
    percent = get("rotary_percent") or 1.0
    if not 0.0 < percent <= 1.0:
        problems.append(f"--rotary-percent {percent}: not a fraction of the head")
    return problems


def glm4_flag_problems(get) -> list[str]:
    """GLM4's flags come together: the two post-sublayer norms and interleaved RoPE make the GLM4 family (HF's
    Glm4ForCausalLM has all three, no other family any), and only GLM4 rotates part of the head. `get`: a flag
    dest's value (`flags.get`). Each problem names its flags."""
    given = [d for d in _GLM4_ONLY if get(d)]
    percent = get("rotary_percent") or 1.0
    if not given:  # Nemotron's partial RoPE: nemotron_flag_problems
        return [] if percent == 1.0 or any(get(d) for d in _NEMOTRON_ONLY) else [
            f"--rotary-percent {percent}: only GLM4 models rotate part of the head (built with "
            f"--post-self-attn-layernorm --post-mlp-layernorm --rotary-interleaved), and Nemotron models (built with "
            f"{_NEMOTRON_HINT}) the two halves of part of it"]
    shown = " ".join(ARCH_FLAGS[d][0] for d in given)
    if get("qk_layernorm") or get("num_experts"):
        other = "--num-experts" if get("num_experts") else "--qk-layernorm"
        return [f"{shown} with {other}: the GLM4 features with another family's (no supported model has both)"]
    problems = []
    missing = [ARCH_FLAGS[d][0] for d in _GLM4_ONLY if d not in given]
    if missing:
        problems.append(f"{shown} without {' '.join(missing)}: GLM4 models (the only family with these features) "
                        "have all three")
    if not 0.0 < percent <= 1.0:
        problems.append(f"--rotary-percent {percent}: not a fraction of the head")
    return problems


def _user_set(config: Any, dest: str) -> bool:
    """The user gave `dest` a value other than its default (a resolved config restates every default)."""
    if dest not in getattr(config, "explicit", ()):
        return False
    defaults = getattr(config, "meta", {}).get("defaults", {})
    return dest not in defaults or config[dest] != defaults[dest]


def arch_for_run(config: Any) -> ModelArch:
    """The model a run trains: the HF config's of --hf-checkpoint (architecture flags given with it were checked
    to agree before the run: relax.config.rules_arch), else the one the architecture flags describe.

    The vocabulary is padded as Megatron pads it when the user asks: to --padded-vocab-size, or to a multiple
    of --make-vocab-size-divisible-by x --tensor-model-parallel-size; otherwise only to a multiple of the
    tensor-parallel size (by `MegatronTrainer`). Padded rows never reach the outputs or the exported weights.
    """
    multiple = 1
    if _user_set(config, "make_vocab_size_divisible_by"):
        multiple = config["make_vocab_size_divisible_by"] * (config.get("tensor_model_parallel_size") or 1)
    if config.get("hf_checkpoint"):
        from transformers import AutoConfig  # ~2 s to import: only where a model is built

        arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(config["hf_checkpoint"]), vocab_multiple=multiple)
    else:
        arch = ModelArch.from_flags(config, vocab_multiple=multiple)
    padded = config.get("padded_vocab_size") if _user_set(config, "padded_vocab_size") else None
    if padded:
        if padded < arch.hf_vocab_size:
            raise ValueError(f"--padded-vocab-size {padded} is smaller than the vocabulary ({arch.hf_vocab_size})")
        arch = dataclasses.replace(arch, vocab_size=padded)
    return arch
