"""Megatron's architecture flags against the model they are used with, before Ray starts.

Launch scripts describe the model twice: a model flag file (`MODEL_ARGS=(--num-layers 28 --hidden-size 1024
...)`) for Megatron, and `--hf-checkpoint` for the tokenizer, the rollout engines and the weights. Relax builds
the trainer's model from the HF config, so every architecture flag the user sets must agree with it; one that
does not is the classic wrong-model-file mistake, and `check_arch_flags` names each such flag, its value and
the HF config's value. A flag at Megatron's default counts as not given (a resolved config restates every
default): the HF config's value is used.

Without an HF config the model would be built from the flags alone (`ModelArch.from_flags`), but a run cannot
start without `--hf-checkpoint` yet: the rollout engines and the prompt tokenizer load it. Such a run is
refused here, after the flags themselves are checked, naming what is missing.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Optional

from relax.formats.model_arch import (ARCH_FLAGS, SIZE_FLAGS, ModelArch, glm4_flag_problems, moe_flag_problems,
                                          nemotron_flag_problems)
from relax.config.errors import ConfigError
from relax.config.presets import embedded_paths
from relax.config.support import same_value


_CHECKED = " With --hf-checkpoint it must agree with the model's config.json (checked before the run)."

# What each honoured architecture flag means (Megatron's meaning), for `relax-train --help`: the flags of
# relax.config.support_training.ARCH_FEATURES. The flags of features no supported model has are not honoured.
# GLM4's --post-self-attn-layernorm and --post-mlp-layernorm are Relax's own (Megatron-LM has no such flags): their
# help is where they are defined (relax.config.flags.misc).
ARCH_FLAG_HELP: dict[str, str] = {
    "num_layers": "Number of transformer layers." + _CHECKED,
    "hidden_size": "Width of the transformer's hidden states." + _CHECKED,
    "ffn_hidden_size": "Width of the MLP's inner layer (unset: 4 x --hidden-size, or 2/3 of that rounded down "
                       "to 64 with --swiglu)." + _CHECKED,
    "num_attention_heads": "Number of attention (query) heads." + _CHECKED,
    "group_query_attention": "Use grouped-query attention with --num-query-groups key/value heads." + _CHECKED,
    "num_query_groups": "Number of key/value head groups; counts only with --group-query-attention (without it "
                        "every head has its own)." + _CHECKED,
    "kv_channels": "Width of each attention head (unset: --hidden-size / --num-attention-heads)." + _CHECKED,
    "swiglu": "Gated SiLU (SwiGLU) MLP." + _CHECKED,
    "squared_relu": "Non-gated MLP with squared ReLU, relu(x)^2 (Nemotron models: HF hidden_act relu2; built with "
                    "--apply-layernorm-1p and --normalization LayerNorm, as Nemotron has all three)." + _CHECKED,
    "normalization": "Normalisation layer type (LayerNorm in Nemotron models, RMSNorm in the others)." + _CHECKED,
    "layernorm_zero_centered_gamma": "LayerNorm whose scale is stored zero-centred and applied as weight + 1 "
                                     "(Nemotron's layernorm1p; with --squared-relu and --normalization LayerNorm)."
                                     + _CHECKED,
    "layernorm_epsilon": "Epsilon of the normalisation layers." + _CHECKED,
    "qk_layernorm": "Normalise queries and keys in each attention layer (Qwen3 models)." + _CHECKED,
    "position_embedding_type": "Kind of position embedding; the supported models use rope." + _CHECKED,
    "use_rotary_position_embeddings": "Rotary position embeddings (older spelling of --position-embedding-type "
                                      "rope)." + _CHECKED,
    "add_position_embedding": "No learned absolute position table (rotary models have none)." + _CHECKED,
    "rotary_base": "Base (theta) of the rotary embedding frequencies." + _CHECKED,
    "rotary_percent": "Fraction of each attention head the rotary embedding rotates (its first dims). Below 1 only "
                      "in GLM4 models (HF partial_rotary_factor, 0.5), built with --post-self-attn-layernorm, "
                      "--post-mlp-layernorm and --rotary-interleaved, and in Nemotron models (0.5, the two halves of "
                      "the rotated part), built with --squared-relu and --apply-layernorm-1p." + _CHECKED,
    "rotary_interleaved": "Rotate interleaved pairs of dims (2i, 2i+1) instead of the two halves of the head. GLM4 "
                          "models only: Relax builds it with --post-self-attn-layernorm and --post-mlp-layernorm, as "
                          "HF's Glm4ForCausalLM computes it." + _CHECKED,
    "use_rope_scaling": "Llama-3.1-style RoPE frequency scaling." + _CHECKED,
    "rope_scaling_factor": "Factor of the Llama-3.1-style RoPE scaling (used with --use-rope-scaling)." + _CHECKED,
    "max_position_embeddings": "Longest sequence the position embedding is built for (unset: --seq-length)."
                               + _CHECKED,
    "untie_embeddings_and_output_weights": "Separate input-embedding and output-layer weights." + _CHECKED,
    "add_bias_linear": "No biases in the linear layers." + _CHECKED,
    "add_qkv_bias": "Biases in the query/key/value projection only (Qwen2 models)." + _CHECKED,
    "vocab_size": "Size of the tokenizer's vocabulary, before padding." + _CHECKED,
    "num_experts": "Experts per MoE layer (unset: a dense model)." + _CHECKED,
    "moe_ffn_hidden_size": "Width of each expert's MLP." + _CHECKED,
    "moe_router_topk": "Experts each token is routed to." + _CHECKED,
    "moe_layer_freq": "Which layers are MoE (1, or a list with 1 for MoE layers); every layer in the supported "
                      "models." + _CHECKED,
    "moe_router_pre_softmax": "Softmax over all experts before choosing the top k (the weights are then not "
                              "renormalised)." + _CHECKED,
    "moe_shared_expert_intermediate_size": "Width of the shared expert's MLP, which every token goes through beside "
                                           "its routed experts (Qwen2-MoE models: HF shared_expert_intermediate_size; "
                                           "needs --moe-shared-expert-gate, as Qwen2-MoE has both)." + _CHECKED,
    "moe_shared_expert_gate": "Gate the shared expert's output by sigmoid(a linear map of the hidden state) "
                              "(Qwen2-MoE's shared_expert_gate)." + _CHECKED,
    "seq_length": "Longest sequence Megatron trains on. Relax's micro-batches take their lengths from the samples "
                  "(prompt + response); this is checked against the model's max_position_embeddings.",
    "padded_vocab_size": "Rows of the trainer's embedding and output layer (at least the vocabulary; the extra "
                         "rows never reach the outputs or the engines).",
    "make_vocab_size_divisible_by": "Pad the trainer's vocabulary to a multiple of this times "
                                    "--tensor-model-parallel-size, when set to another value than the default "
                                    "(at the default it is padded to a multiple of the tensor-parallel size only).",
}


def user_set_flags(v: dict, explicit, defaults: Optional[dict] = None) -> list[str]:
    """The architecture flags the user set to a value other than Megatron's default, in table order."""
    defaults = defaults or {}
    order = list(ARCH_FLAGS) + list(SIZE_FLAGS)
    return [d for d in order if d in explicit and d in v
            and not (d in defaults and same_value(v[d], defaults[d]))]


def flag_name(dest: str) -> str:
    return ARCH_FLAGS[dest][0] if dest in ARCH_FLAGS else SIZE_FLAGS.get(dest, "--" + dest.replace("_", "-"))


def _agree(value: Any, expected: Any) -> bool:
    if isinstance(value, (int, float)) and isinstance(expected, (int, float)) \
            and not isinstance(value, bool) and not isinstance(expected, bool):
        return math.isclose(float(value), float(expected), rel_tol=1e-9, abs_tol=0.0)
    return same_value(value, expected)


def _short(value: Any) -> str:
    if isinstance(value, list) and len(value) > 6:  # a layer pattern such as [1]*48
        return f"[{', '.join(map(str, value[:3]))}, ...] ({len(value)} entries)"
    return str(value)


def _shown(dest: str, value: Any) -> str:
    if isinstance(value, bool):
        return flag_name(dest)  # a switch: naming it says it is set
    return f"{flag_name(dest)} {_short(value)}"


def _hf_side(dest: str, expected: Any, hf: ModelArch) -> str:
    hint = ARCH_FLAGS[dest][1] if dest in ARCH_FLAGS else dest
    if isinstance(expected, bool):
        return f"the HF config's model is built without it ({hint})"
    if expected is None:
        dense = not hf.is_moe and dest.startswith(("moe_", "num_experts"))
        return f"the HF config has none ({'a dense model' if dense else hint})"
    return f"the HF config gives {expected} ({hint})"


def mismatches(v: dict, given: list[str], hf: ModelArch) -> list[str]:
    """Each given flag that describes another model than `hf`: the flag, its value and the HF config's."""
    want = hf.to_flags()
    out = []
    for dest in given:
        value = v[dest]
        if dest in ("group_query_attention", "num_query_groups", "rope_scaling_factor", "moe_layer_freq") \
                or dest in SIZE_FLAGS:
            continue  # compared below, as Megatron reads them
        if not _agree(value, want[dest]):
            out.append(f"{_shown(dest, value)}: {_hf_side(dest, want[dest], hf)}")
    if {"group_query_attention", "num_query_groups"} & set(given):
        gqa = bool(v.get("group_query_attention"))
        groups = v.get("num_query_groups") if gqa else (v.get("num_attention_heads") or hf.num_attention_heads)
        if groups != hf.num_query_groups:
            how = (f"--group-query-attention with --num-query-groups {groups}" if gqa
                   else f"--num-query-groups {v.get('num_query_groups')} without --group-query-attention (Megatron "
                        f"then gives every one of the {groups} heads its own key/value)")
            out.append(f"{how}: the HF config gives {hf.num_query_groups} key/value heads (num_key_value_heads)")
    if "rope_scaling_factor" in given and (hf.rope_scaling_factor is not None or v.get("use_rope_scaling")):
        if not _agree(v["rope_scaling_factor"], hf.rope_scaling_factor):
            hf_side = _hf_side("rope_scaling_factor", hf.rope_scaling_factor, hf)
            out.append(f"--rope-scaling-factor {v['rope_scaling_factor']}: {hf_side}")
    if {"use_rope_scaling", "rope_scaling_factor"} & set(given) and v.get("use_rope_scaling"):
        off = hf.llama3_rope_off_megatron()
        if off:  # Megatron's --use-rope-scaling computes other frequencies than the HF config's model
            fixed = ", ".join(f"{name} {megatron}" for name, (_, megatron) in off.items())
            hf_values = ", ".join(f"{name} {value}" for name, (value, _) in off.items())
            out.append(f"--use-rope-scaling: Megatron's llama3 RoPE scaling fixes {fixed}, the HF config's "
                       f"rope_scaling gives {hf_values} (drop --use-rope-scaling and --rope-scaling-factor: Relax builds the "
                       "HF config's scaling, all four parameters, without them)")
    if "moe_layer_freq" in given:
        freq = v["moe_layer_freq"]
        all_moe = freq == 1 or (isinstance(freq, list) and len(freq) == hf.num_layers and all(f == 1 for f in freq))
        if not (hf.is_moe and all_moe):
            hf_side = _hf_side("moe_layer_freq", 1 if hf.is_moe else None, hf)
            out.append(f"--moe-layer-freq {_short(freq)}: {hf_side}")
    if "seq_length" in given and v["seq_length"] > hf.max_position_embeddings:
        out.append(f"--seq-length {v['seq_length']}: longer than the HF config's max_position_embeddings "
                   f"{hf.max_position_embeddings}")
    if "padded_vocab_size" in given:
        padded, tp = v["padded_vocab_size"], v.get("tensor_model_parallel_size") or 1
        if padded < hf.hf_vocab_size:
            out.append(f"--padded-vocab-size {padded}: smaller than the HF config's vocab_size {hf.hf_vocab_size}")
        elif padded % tp:
            out.append(f"--padded-vocab-size {padded}: not a multiple of --tensor-model-parallel-size {tp}")
    return out


@functools.lru_cache(maxsize=1)
def _embedded_arch() -> ModelArch:
    """The embedded default's model, as it will be built at start-up (relax.models.embedded)."""
    from relax.models.embedded import EMBEDDED_ARCH  # imports torch: only for the embedded default with flags
    from relax.models.tiny import build_byte_tokenizer, build_hf_config

    vocab = ((len(build_byte_tokenizer()) + 63) // 64) * 64  # as build_tiny_model_dir rounds it
    return ModelArch.from_hf_config(build_hf_config(EMBEDDED_ARCH, vocab))


def is_embedded_model(v: dict) -> bool:
    return v["hf_checkpoint"] == embedded_paths(v["output_dir"])[0]


def hf_arch(v: dict) -> Optional[ModelArch]:
    """The model of --hf-checkpoint (or of the embedded default); None when the folder has no config.json (a
    path of another machine in a --dry-run; a real run's checks before Ray report the folder)."""
    path = v["hf_checkpoint"]
    if not (Path(path) / "config.json").is_file():
        return _embedded_arch() if is_embedded_model(v) else None
    try:
        from transformers import AutoConfig  # ~2 s to import: only when architecture flags are given

        hf_config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # the trainer reads the model the same way, so the run could not start either
        raise ConfigError(f"--hf-checkpoint {path}: transformers cannot read its config.json ({type(exc).__name__}: "
                          f"{exc}), so the architecture flags cannot be checked against it") from None
    try:
        return ModelArch.from_hf_config(hf_config)
    except NotImplementedError as exc:
        raise ConfigError(f"--hf-checkpoint {path}: {exc}, so the architecture flags cannot describe it") from None
    except (ValueError, TypeError, ArithmeticError, AttributeError) as exc:  # a config.json missing sizes
        raise ConfigError(f"--hf-checkpoint {path}: its config.json does not describe a model Relax can build "
                          f"({type(exc).__name__}: {exc}), so the architecture flags cannot be checked") from None


def rotary_scaling_factor_problems(v: dict, explicit, defaults: Optional[dict], hf: Optional[ModelArch]) -> list[str]:
    """--rotary-scaling-factor is multi-latent attention's YaRN factor in Megatron (MLATransformerConfig); a GPT
    model's Llama 3 scaling reads --rope-scaling-factor instead, so the flag has no effect here (a warning,
    relax.config.support_megatron). Model flag files still pass it beside --use-rope-scaling meaning the Llama 3
    factor: one that differs from the factor the run uses is refused, naming both, rather than silently ignored."""
    defaults = defaults or {}
    if "rotary_scaling_factor" not in explicit or same_value(v.get("rotary_scaling_factor"),
                                                             defaults.get("rotary_scaling_factor", 1.0)):
        return []
    value = v["rotary_scaling_factor"]
    if hf is not None:
        factor, where = hf.rope_scaling_factor, "the HF config's rope_scaling.factor"
    else:
        factor = v.get("rope_scaling_factor") if v.get("use_rope_scaling") else None
        where = "--rope-scaling-factor"
    if factor is None or _agree(value, factor):
        return []
    return [f"--rotary-scaling-factor {value}: Megatron reads it only for multi-latent attention (YaRN); the Llama 3 "
            f"RoPE scaling of this model uses {where}, {factor} (set --rope-scaling-factor to the model's factor and "
            "drop --rotary-scaling-factor)"]


def check_arch_flags(v: dict, explicit, defaults: Optional[dict] = None) -> None:
    """Architecture flags the user set must describe the model the run trains (see the module docstring)."""
    given = user_set_flags(v, explicit, defaults)
    rotary = "rotary_scaling_factor" in explicit
    if not given and not rotary:
        return
    if given and not v.get("hf_checkpoint"):
        refuse_without_hf(v, given)
    hf = hf_arch(v) if v.get("hf_checkpoint") else None
    if hf is None:  # nothing to compare with; each family's own features must still come together
        problems = (glm4_flag_problems(v.get) + moe_flag_problems(v.get, complete=False)
                    + nemotron_flag_problems(v.get)) if given else []
        problems += rotary_scaling_factor_problems(v, explicit, defaults, None)
        if problems:
            raise ConfigError("cannot build the model from the architecture flags: " + "; ".join(problems))
        return
    problems = mismatches(v, given, hf) + rotary_scaling_factor_problems(v, explicit, defaults, hf)
    if problems:
        if is_embedded_model(v):
            where = "the embedded default model (built when neither --hf-checkpoint nor --prompt-data is given)"
            fix = "give --hf-checkpoint with the model these flags describe, or drop them"
        else:
            where = f"the model of --hf-checkpoint {v['hf_checkpoint']}"
            fix = ("source the flag file of this model, or drop the architecture flags (the HF config alone defines "
                   "the model)")
        raise ConfigError(f"architecture flags disagree with {where}: " + "; ".join(problems)
                          + f". The run trains the HF config's model, so the model flag file (the MODEL_ARGS of "
                            f"the launch script) is probably for another model: {fix}")


def refuse_without_hf(v: dict, given: list[str]) -> None:
    """No HF config: the flags must describe a buildable model, and the run still needs --hf-checkpoint."""
    try:
        ModelArch.from_flags(v)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    names = ", ".join(flag_name(d) for d in given)
    raise ConfigError(f"the architecture flags ({names}) describe the model, but a run also needs --hf-checkpoint: "
                      "the rollout engines and the prompt tokenizer load the model folder, and a model built from "
                      "the flags alone has neither. Add --hf-checkpoint with a folder of this model (its config.json "
                      "is checked against the flags); the weights may still come from --ref-load or --load")
