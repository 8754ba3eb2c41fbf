"""The embedded engine's request and batch records, and SGLang-shaped replies."""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from relax.backends.embedded.sampling import SamplingParams

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.float32  # CPU: float32 is both faster and exact (see notes/cpu-stack.md)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


class EngineError(Exception):
    """A request the engine refuses (bad input, engine state). `status` is the HTTP code."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(eq=False)  # identity: requests are compared and looked up as the objects they are
class GenRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_routed_experts: bool = False  # R3: meta_info["routed_experts"] (see routing.py)
    lora_name: str | None = None  # the loaded adapter it names (SGLang's lora_path; lora.py), None: the base
    log_metrics: bool = True  # False for /health_generate's probe, which SGLang leaves out of its counters too
    # --- state, owned by the scheduler thread ---
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish_reason: dict | None = None
    matched_stop_str: str | None = None
    generator: torch.Generator | None = None
    created: float = field(default_factory=time.time)
    first_token_time: float | None = None
    future: Future = field(default_factory=Future)
    stop_ids: frozenset = frozenset()
    routed_chunks: list = field(default_factory=list)  # [t, layers, k] int32 per forward pass that ran it
    cached_tokens: int = 0  # prompt tokens reused from another request's prefill row (prefix.py)

    @property
    def max_new(self) -> int:
        return self.params.max_new_tokens


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: Future
    needs_idle: bool = False
    name: str = "command"


class _RunningBatch:
    """Rows of running requests with their KV cache, padding mask and next inputs."""

    def __init__(self, reqs, cache, mask, pos, last):
        self.reqs: list[GenRequest] = reqs
        self.cache = cache
        self.mask: torch.Tensor = mask  # [B, L] 1 = real token, 0 = padding
        self.pos: torch.Tensor = pos  # [B] position id of the token fed next
        self.last: torch.Tensor = last  # [B] token fed next

    def __len__(self) -> int:
        return len(self.reqs)


def checked_prompt(input_ids: list[int], vocab_size: int, context_length: int) -> list[int]:
    """`input_ids` as a new list of ints, or EngineError if empty, out of the vocabulary or too long."""
    if not input_ids:
        raise EngineError("input_ids is empty")
    ids = [int(t) for t in input_ids]
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise EngineError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= context_length:
        raise EngineError(
            f"the input ({len(ids)} tokens) is longer than the model's context length ({context_length} tokens)"
        )
    return ids


def _cache_layers_mergeable(cache) -> bool:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _left_pad(t: torch.Tensor, dim: int, amount: int) -> torch.Tensor:
    if amount == 0:
        return t
    shape = list(t.shape)
    shape[dim] = amount
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)


_DECODERS: "weakref.WeakKeyDictionary[Any, Callable[[list[int], bool], str]]" = weakref.WeakKeyDictionary()


def _fast_backend(tokenizer: Any):
    """The `tokenizers.Tokenizer` whose `decode` gives exactly `tokenizer.decode`'s text, or None.

    transformers' fast tokenizers decode a list of ids as `self._tokenizer.decode(ids, skip_special_tokens)`
    plus an optional clean-up of spaces; around that, `decode` converts the ids with `to_py_obj`, a generator
    over the list (11% of the embedded server's CPU per step of the embedded default when every reply went
    through it). Only when the tokenizer uses those stock methods and no clean-up is the backend called directly."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend as Fast  # transformers 5
        except ImportError:  # pragma: no cover - transformers 4
            from transformers import PreTrainedTokenizerFast as Fast
    except ImportError:  # pragma: no cover
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, Fast) or cls._decode is not Fast._decode:
        return None
    if cls.decode is not PreTrainedTokenizerBase.decode:
        return None
    return backend


def text_decoder(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)` with `tokenizer.decode`'s text (through the fast backend when it can)."""
    try:
        return _DECODERS[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = _fast_backend(tokenizer)
    if backend is None:
        return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)

    def decode(ids: list[int], skip: bool) -> str:  # holds the backend only: the tokenizer stays collectable
        return backend.decode(ids, skip_special_tokens=skip)

    try:
        _DECODERS[tokenizer] = decode
    except TypeError:  # pragma: no cover - not weak-referenceable
        pass
    return decode


def response_payload(r: "GenRequest", tokenizer: Any, weight_version: str) -> dict:
    """SGLang's /generate reply for a finished (or aborted) request."""
    p = r.params
    ids_for_text = list(r.output_ids)
    reason = r.finish_reason or {}
    if reason.get("type") == "stop" and isinstance(reason.get("matched"), int) and not p.no_stop_trim:
        ids_for_text = ids_for_text[:-1]
    text = text_decoder(tokenizer)(ids_for_text, p.skip_special_tokens)
    if r.matched_stop_str is not None and not p.no_stop_trim:
        cut = text.find(r.matched_stop_str)
        if cut >= 0:
            text = text[:cut]
    now = time.time()
    meta: dict[str, Any] = {
        "id": r.rid,
        "finish_reason": reason,
        "prompt_tokens": len(r.input_ids),
        "completion_tokens": len(r.output_ids),
        "cached_tokens": r.cached_tokens,
        "weight_version": weight_version,
        "e2e_latency": now - r.created,
    }
    if r.return_logprob:
        meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(r.output_logprobs, r.output_ids)]
        if r.input_logprobs is not None:
            start = max(0, min(r.logprob_start_len, len(r.input_ids)))
            meta["input_token_logprobs"] = [
                [lp, tid, None] for lp, tid in zip(r.input_logprobs, r.input_ids[start:])
            ]
        else:
            meta["input_token_logprobs"] = []
        if r.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [[[lp, tid, None] for lp, tid in row] for row in r.output_top]
    if r.return_routed_experts:
        from relax.backends.embedded.routing import META_KEY, encode_routed_experts

        meta[META_KEY] = encode_routed_experts(r.routed_chunks)
    return {"text": text, "output_ids": list(r.output_ids), "meta_info": meta}


def prompt_logprobs(group: list[GenRequest], logits: torch.Tensor, maxlen: int, rows: list[int] | None = None) -> None:
    """Fill `input_logprobs` of the requests of a left-padded prefill that asked for prompt log-probs.
    `rows[i]`: the logits row request i reads when identical prompts shared one (`prefix.py`)."""
    for i, r in enumerate(group):
        if not (r.return_logprob and r.logprob_start_len >= 0):
            continue
        n = len(r.input_ids)
        t = 1.0 if r.params.temperature == 0.0 else r.params.temperature
        row = logits[i if rows is None else rows[i], maxlen - n:, :].float() / t  # positions of this prompt
        lp = torch.log_softmax(row[:-1], dim=-1)
        tgt = torch.tensor(r.input_ids[1:], dtype=torch.long).to(lp.device)
        vals = lp.gather(1, tgt[:, None])[:, 0].tolist()
        full = [None] + vals
        r.input_logprobs = full[max(0, min(r.logprob_start_len, n)):]


def check_finish(r: GenRequest, tok: int, tokenizer: Any) -> dict | None:
    """Why `r` stops after appending `tok` (stop token, stop string, length), or None."""
    n = len(r.output_ids)
    if n >= r.params.min_new_tokens and tok in r.stop_ids:
        return {"type": "stop", "matched": tok}
    if r.params.stop and n >= r.params.min_new_tokens:
        longest = max(len(s) for s in r.params.stop)
        tail_ids = r.output_ids[-(4 * longest + 8):]
        tail = text_decoder(tokenizer)(tail_ids, r.params.skip_special_tokens)
        for s in r.params.stop:
            if s in tail:
                r.matched_stop_str = s
                return {"type": "stop", "matched": s}
    if n >= r.max_new:
        return {"type": "length", "length": r.max_new}
    return None
