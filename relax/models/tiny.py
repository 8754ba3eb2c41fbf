"""A tiny model and a byte-level tokenizer, built locally (no model hub).

The embedded default of Relax trains this model on CPU. Everything here is
deterministic given the seed, and the result is an ordinary Hugging Face folder
that `AutoModelForCausalLM` / `AutoTokenizer` reload.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyArch:
    """Shape of the tiny model (a Qwen2-, Llama-, Qwen3-, GLM4-, Qwen2-MoE- or Nemotron-family causal LM)."""

    family: str = "qwen2"  # qwen2 | llama | qwen3 | glm4 | qwen2_moe | nemotron
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False


def build_byte_tokenizer():
    """A byte-level tokenizer: the 256 byte symbols, no merges, ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {sym: i for i, sym in enumerate(sorted(byte_alphabet))}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_hf_config(arch: TinyArch, vocab_size: int):
    from transformers import Glm4Config, LlamaConfig, NemotronConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        max_position_embeddings=arch.max_position_embeddings,
        rope_theta=arch.rope_theta,
        rms_norm_eps=arch.rms_norm_eps,
        tie_word_embeddings=arch.tie_word_embeddings,
        dtype="float32",
    )
    if arch.family == "qwen2":
        return Qwen2Config(**common)
    if arch.family == "llama":
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if arch.family == "qwen3":
        return Qwen3Config(**common, head_dim=arch.hidden_size // arch.num_attention_heads)
    if arch.family == "glm4":  # GLM4-9B's features: half the head rotated (interleaved), QKV biases, post norms
        return Glm4Config(**common, head_dim=arch.hidden_size // arch.num_attention_heads, partial_rotary_factor=0.5,
                          attention_bias=True)
    if arch.family == "qwen2_moe":  # Qwen1.5-MoE's features: routed experts plus a gated shared expert, QKV biases,
        # top-k routing weights not renormalised (norm_topk_prob false)
        return Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, norm_topk_prob=False, qkv_bias=True)
    if arch.family == "nemotron":  # Nemotron-Mini's features: squared-ReLU MLP, LayerNorm1P, half the head rotated
        nemotron = {k: v for k, v in common.items() if k not in ("rope_theta", "rms_norm_eps")}
        return NemotronConfig(**nemotron, head_dim=arch.hidden_size // arch.num_attention_heads,
                              norm_eps=arch.rms_norm_eps,
                              rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta,
                                               "partial_rotary_factor": 0.5})
    raise ValueError(f"unknown tiny model family {arch.family!r} (qwen2, llama, qwen3, glm4, qwen2_moe, nemotron)")


def build_tiny_model_dir(path: str | Path, arch: TinyArch | None = None, seed: int = 0) -> Path:
    """Write a randomly initialised tiny model and its tokenizer to `path`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    arch = arch or TinyArch()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_byte_tokenizer()
    # Round the vocabulary up to a multiple of 64 so tensor-parallel splits divide it.
    vocab_size = ((len(tokenizer) + 63) // 64) * 64
    config = build_hf_config(arch, vocab_size)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "relax_tiny.json").write_text(json.dumps({"family": arch.family, "seed": seed}))
    return path
