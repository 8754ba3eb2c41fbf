"""Token cache for text-based multi-turn agents: `relax.backends.relax_router.radix_middleware.RadixTreeMiddleware`.

An agent that speaks text (it sends the conversation so far as `text` and appends the engine's text
answer and the tool's text) would train on a re-tokenisation of that text, which often differs from
the tokens the engine produced (a byte-level token sequence that is not valid UTF-8 decodes to U+FFFD;
merges differ across a turn boundary). This middleware keeps, in a radix tree keyed by text, the exact
tokens behind every text it has seen:

- `POST /generate` with a string `text`: the longest cached text that prefixes it gives its tokens;
  only the rest of the text is tokenised (the tool's or user's turn, `add_special_tokens=False`, as
  Relax encodes prompts). The engine receives `input_ids` (log-probs requested), and the request
  text + answer text is cached with input ids + output ids, the answer's log-probs and a loss mask
  (1 on engine tokens, 0 on tokenised text). The answer is passed back unchanged, plus
  `meta_info["cached_prefix_tokens"]` (how many input tokens came from the cache).
- `POST /retrieve_from_text {"text"}` (needs the run's key): `{"tokens", "logprobs", "loss_mask",
  "weight_version", "cached_tokens"}` for that text, the same way: what an agent trains on.

Requests with `input_ids`, a list of texts, or a streamed answer pass through untouched. Two samples
whose answer texts are equal but whose tokens differ map to one key: the later one is kept and
`conflicts` counts it (`GET /radix_cache/stats`); the example in examples/multiturn checks its
prompt prefix and fails loudly instead of training on other tokens.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass
from typing import Any, Optional

from aiohttp import web

from relax.backends.relax_router.middleware import ProxyRequest, ProxyResponse
from relax.backends.relax_router.radix import RadixTree

logger = logging.getLogger("relax.router.radix")

MAX_ENTRIES = 50_000
# Tokens kept over all entries (each entry holds its whole conversation: 13 bytes a token, so ~400 MB). An
# entry dropped while its conversation still runs makes the next turn re-tokenise that conversation; the
# example agent detects it (examples/multiturn/text_generate.py) and `evictions` counts drops.
MAX_TOKENS = 32_000_000


@dataclass(frozen=True)
class TokenRecord:
    """A conversation's tokens, as compact arrays (int32 ids, float64 log-probs as the engine sent them, int8 mask)."""

    tokens: array
    logprobs: array
    loss_mask: array
    weight_version: Any = None

    @classmethod
    def of(cls, tokens, logprobs, loss_mask, weight_version: Any = None) -> "TokenRecord":
        return cls(array("i", tokens), array("d", logprobs), array("b", loss_mask), weight_version)

    def extended(self, tokens, logprobs, loss_mask, weight_version: Any = None) -> "TokenRecord":
        return TokenRecord(self.tokens + array("i", tokens), self.logprobs + array("d", logprobs),
                           self.loss_mask + array("b", loss_mask),
                           self.weight_version if weight_version is None else weight_version)


class TokenCache:
    """Text -> TokenRecord with longest-prefix lookup; the rest of a text is tokenised."""

    def __init__(self, tokenizer: Any, max_entries: int = MAX_ENTRIES, max_tokens: int = MAX_TOKENS):
        self.tokenizer = tokenizer
        self.tree: RadixTree[TokenRecord] = RadixTree(max_entries, max_size=max_tokens)
        self.hits = self.misses = self.conflicts = self.inserts = 0

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def lookup(self, text: str) -> tuple[TokenRecord, int]:
        """The record of `text` (cached prefix + tokenised rest) and how many of its tokens were cached."""
        matched, rec = self.tree.longest_prefix(text)
        if rec is None:
            self.misses += 1
            rec, matched = TokenRecord.of((), (), ()), 0
        else:
            self.hits += 1
        rest = self.encode(text[matched:])
        if not rest:
            return rec, len(rec.tokens)
        return rec.extended(rest, [0.0] * len(rest), [0] * len(rest)), len(rec.tokens)

    def insert(self, text: str, record: TokenRecord) -> None:
        evictions = self.tree.evictions
        old = self.tree.insert(text, record, size=len(record.tokens))
        self.inserts += 1
        if old is not None and old.tokens != record.tokens:
            self.conflicts += 1
        if self.tree.evictions > evictions and evictions == 0:
            logger.warning("the radix token cache is full (%d entries, %d tokens): least recently used "
                           "conversations are dropped from now on", len(self.tree), self.tree.size)

    def stats(self) -> dict:
        return {"entries": len(self.tree), "tokens": self.tree.size, "hits": self.hits, "misses": self.misses,
                "inserts": self.inserts, "conflicts": self.conflicts, "evictions": self.tree.evictions}


def _answer_tokens(answer: dict) -> Optional[tuple[list[int], list[float]]]:
    meta = answer.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs")
    if pairs:
        return [int(p[1]) for p in pairs], [float(p[0]) for p in pairs]
    ids = answer.get("output_ids")
    return (list(ids), [0.0] * len(ids)) if isinstance(ids, list) else None


class RadixTreeMiddleware:
    def __init__(self, router: Any, tokenizer: Any = None):
        if tokenizer is None:
            from transformers import AutoTokenizer

            path = router.settings.tokenizer
            if not path:
                raise ValueError("RadixTreeMiddleware needs the model's tokenizer (the router's --tokenizer)")
            tokenizer = AutoTokenizer.from_pretrained(path)
        self.cache = TokenCache(tokenizer)

    async def handle(self, request: ProxyRequest, call_next) -> ProxyResponse:
        body = request.body
        if (request.path != "/generate" or not isinstance(body, dict) or not isinstance(body.get("text"), str)
                or "input_ids" in body or body.get("stream")):
            return await call_next(request)
        text = body["text"]
        # on the event loop: a fast tokenizer used from several threads at once can fail ("Already borrowed")
        record, cached = self.cache.lookup(text)
        fwd = {k: v for k, v in body.items() if k != "text"}
        fwd["input_ids"] = record.tokens.tolist()
        fwd["return_logprob"] = True
        resp = await call_next(ProxyRequest(request.method, request.path, fwd, request.query, request.route_key))
        if resp.status != 200 or not isinstance(resp.body, (dict, list)):
            return resp
        answers = resp.body if isinstance(resp.body, list) else [resp.body]  # a list: SGLang's `n` copies
        for answer in answers:
            got = _answer_tokens(answer) if isinstance(answer, dict) else None
            if got is None or not isinstance(answer.get("text"), str):
                continue
            ids, logprobs = got
            meta = answer.setdefault("meta_info", {})
            self.cache.insert(text + answer["text"], record.extended(ids, logprobs, [1] * len(ids),
                                                                     meta.get("weight_version")))
            meta["cached_prefix_tokens"] = cached
        return resp

    async def retrieve(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("text"), str):
            return web.json_response({"error": {"message": 'give {"text": "..."}'}}, status=400)
        record, cached = self.cache.lookup(body["text"])
        return web.json_response({"tokens": record.tokens.tolist(), "logprobs": record.logprobs.tolist(),
                                  "loss_mask": record.loss_mask.tolist(), "weight_version": record.weight_version,
                                  "cached_tokens": cached})

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response(self.cache.stats())

    def routes(self):
        return [("POST", "/retrieve_from_text", self.retrieve), ("GET", "/radix_cache/stats", self.stats)]
