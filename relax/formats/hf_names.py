"""Megatron-core parameter names to Hugging Face names, the pure naming rule shared by the weight conversion
(relax.backends.megatron.hf_weights), the PEFT adapters (relax.backends.megatron.lora_peft) and the LoRA options
real SGLang engines are launched with (relax.roles.engine.lora_server_args)."""

from __future__ import annotations

from typing import Optional

from relax.formats.model_arch import ModelArch

# --lora-target-modules (Megatron's linears) -> the parameter suffix of that linear inside a decoder layer
LORA_TARGET_SUFFIX = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
                      "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}


def layer_hf_names(layer: int, suffix: str, arch: Optional[ModelArch] = None) -> Optional[tuple[str, list[str]]]:
    """(kind, HF names) for a Megatron parameter suffix inside layer `layer` of `arch` (None: a gated MLP with
    separate gate and up projections). GLM4 holds the MLP's gate and up projections as one tensor (gate_up_proj,
    gate rows first); a model without --swiglu has no gate (Nemotron's up_proj -> relu^2 -> down_proj).

    kind is one of "copy", "qkv", "fc1" (HF gate and up tensors), "gate_up" (one HF tensor, [gate; up]).
    """
    gate_up = arch is not None and arch.hf_family == "glm4"
    gated = arch is None or arch.swiglu
    p = f"model.layers.{layer}."
    attn = p + "self_attn."
    if suffix in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
        return "copy", [p + "input_layernorm.weight"]
    if suffix in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        return "copy", [p + "post_attention_layernorm.weight"]
    # LayerNorm biases (Nemotron); Transformer Engine fuses the norm into the next linear layer
    if suffix in ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias"):
        return "copy", [p + "input_layernorm.bias"]
    if suffix in ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"):
        return "copy", [p + "post_attention_layernorm.bias"]
    if suffix == "self_attention.linear_qkv.weight":
        return "qkv", [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"]
    if suffix == "self_attention.linear_qkv.bias":
        return "qkv", [attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"]
    if suffix == "self_attention.q_layernorm.weight":
        return "copy", [attn + "q_norm.weight"]
    if suffix == "self_attention.k_layernorm.weight":
        return "copy", [attn + "k_norm.weight"]
    if suffix == "self_attention.linear_proj.weight":
        return "copy", [attn + "o_proj.weight"]
    if suffix == "mlp.linear_fc1.weight":
        if gate_up:
            return "gate_up", [p + "mlp.gate_up_proj.weight"]
        if not gated:
            return "copy", [p + "mlp.up_proj.weight"]
        return "fc1", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    if suffix == "mlp.linear_fc2.weight":
        return "copy", [p + "mlp.down_proj.weight"]
    if suffix in ("post_self_attn_layernorm.weight", "post_mlp_layernorm.weight"):  # GLM4
        return "copy", [p + suffix]
    if suffix == "mlp.router.weight":
        return "copy", [p + "mlp.gate.weight"]
    # Qwen2-MoE's shared expert (megatron-core's SharedExpertMLP: a TP-split MLP plus an unsplit gate [1, hidden])
    if suffix == "mlp.shared_experts.linear_fc1.weight":
        return "fc1", [p + "mlp.shared_expert.gate_proj.weight", p + "mlp.shared_expert.up_proj.weight"]
    if suffix == "mlp.shared_experts.linear_fc2.weight":
        return "copy", [p + "mlp.shared_expert.down_proj.weight"]
    if suffix == "mlp.shared_experts.gate_weight":
        return "copy", [p + "mlp.shared_expert_gate.weight"]
    return None


def lora_hf_modules(arch: Optional[ModelArch], targets: list[str] | tuple[str, ...]) -> list[str]:
    """The HF module names (q_proj, gate_up_proj, ...) of Megatron LoRA `targets` in `arch`, in order, as PEFT's
    and SGLang's target_modules name them."""
    out: list[str] = []
    for target in targets:
        _, names = layer_hf_names(0, LORA_TARGET_SUFFIX[target] + ".weight", arch)
        for name in names:
            module = name.removesuffix(".weight").rsplit(".", 1)[1]
            if module not in out:
                out.append(module)
    return out
