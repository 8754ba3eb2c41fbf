"""Routed-expert capture for rollout routing replay (R3): which experts each MoE layer's router picked for
every token the engine ran through the model.

SGLang's interface, kept here: a /generate request with `"return_routed_experts": true` gets
`meta_info["routed_experts"]`, the base64 of little-endian int32 top-k expert ids laid out
[tokens, layers, k] (row-major), for the request's tokens that went through the model: the prompt and every
generated token except the last one (it is sampled but never fed back), i.e. prompt + completion - 1 rows.
`layers` are the MoE layers in model order (for Qwen3-MoE with every layer sparse, layer i of the HF model).

Capture: a forward hook on every MoE router module (`mlp.gate` of transformers' Qwen3-MoE family, which
returns (logits, scores, top-k indices)); during one forward pass of the engine (a prefill of a left-padded
group, or one decode step of the running batch) each router's [B * T, k] indices are kept, and afterwards
the engine hands every request its own rows (`take_prefill` / `take_decode`), so routes stay per request
however requests are batched. Capture is off unless some request of the pass asked for it.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

__all__ = ["RouteCapture", "decode_routed_experts", "encode_routed_experts", "find_routers"]

REQUEST_FIELD = "return_routed_experts"
META_KEY = "routed_experts"


def find_routers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """(router module, top-k) of every MoE layer, in model order: modules whose class name ends in
    "TopKRouter" or, failing that, the `gate` of an MLP that has `experts`."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers:
        routers = [m.gate for m in model.modules()
                   if hasattr(m, "experts") and isinstance(getattr(m, "gate", None), torch.nn.Module)]
    cfg = getattr(model, "config", None)  # the HF model config: only MoE models have num_experts_per_tok
    default_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
    return [(m, int(getattr(m, "top_k", None) or default_k)) for m in routers]


def _topk_indices(output: Any, topk: int) -> torch.Tensor:
    """The [N, k] expert ids a router output carries: the integer tensor of a (logits, scores, indices) tuple,
    else the top-k of the logits (routers that return logits only)."""
    if isinstance(output, (tuple, list)):
        for t in reversed(output):
            if isinstance(t, torch.Tensor) and not t.is_floating_point():
                return t.reshape(-1, t.shape[-1])
        output = output[0]
    logits = output.reshape(-1, output.shape[-1])
    return torch.topk(logits.float(), topk, dim=-1).indices


class RouteCapture:
    """Forward hooks on a model's MoE routers; `recording(on)` around one forward pass keeps their choices."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        self._on = False
        self._seen: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles = [m.register_forward_hook(self._hook(i, k)) for i, (m, k) in enumerate(self.routers)]

    @property
    def available(self) -> bool:
        return bool(self.routers)

    def _hook(self, layer: int, topk: int):
        def hook(module, args, output):
            if self._on:
                self._seen[layer] = _topk_indices(output, topk).detach().to("cpu", torch.int32)
        return hook

    @contextmanager
    def recording(self, on: bool):
        self._seen = [None] * len(self.routers)
        self._on = bool(on) and self.available
        try:
            yield self
        finally:
            self._on = False

    def _grid(self, batch: int, length: int) -> torch.Tensor:
        """This pass's routes as [B, T, L, k]."""
        if any(s is None for s in self._seen):
            raise RuntimeError("routed experts: a MoE router did not run in this forward pass")
        stacked = torch.stack([s.view(batch, length, -1) for s in self._seen])  # [L, B, T, k]
        return stacked.permute(1, 2, 0, 3)

    def take_prefill(self, group: Sequence[Any], maxlen: int, rows: Sequence[int] | None = None) -> None:
        """After a prefill of `group` left-padded to `maxlen`: each asking request gets its prompt's rows.
        `rows[i]`: the prefill row request i reads when identical prompts shared one (`prefix.py`)."""
        if not self._seen or self._seen[0] is None:
            return
        grid = self._grid(len(group) if rows is None else max(rows) + 1, maxlen)
        for i, r in enumerate(group):
            if r.return_routed_experts:
                r.routed_chunks.append(grid[i if rows is None else rows[i], maxlen - len(r.input_ids):].clone())

    def take_decode(self, reqs: Sequence[Any]) -> None:
        """After one decode step of `reqs` (one token each): each asking request gets its token's row."""
        if not self._seen or self._seen[0] is None:
            return
        grid = self._grid(len(reqs), 1)
        for i, r in enumerate(reqs):
            if r.return_routed_experts:
                r.routed_chunks.append(grid[i].clone())


def encode_routed_experts(chunks: Sequence[torch.Tensor]) -> str:
    """SGLang's `meta_info["routed_experts"]`: base64 of the int32 [tokens, layers, k] routes."""
    if not chunks:
        return ""
    routes = torch.cat(list(chunks), dim=0).to(torch.int32).contiguous().numpy()
    return base64.b64encode(routes.astype("<i4", copy=False).tobytes()).decode("ascii")


def decode_routed_experts(data: str, rows: int) -> np.ndarray:
    """[rows, layers * k] int32 from `meta_info["routed_experts"]` of a reply covering `rows` tokens."""
    flat = np.frombuffer(base64.b64decode(data), dtype="<i4") if data else np.zeros(0, dtype="<i4")
    if rows <= 0:
        if flat.size:
            raise ValueError(f"routed experts: {flat.size} values for 0 tokens")
        return flat.reshape(0, 0).astype(np.int32)
    if flat.size % rows:
        raise ValueError(f"routed experts: {flat.size} values do not split into {rows} tokens")
    return flat.reshape(rows, flat.size // rows).astype(np.int32)
