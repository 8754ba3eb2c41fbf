"""Rollout routing replay (R3) routes as a ``Sample`` carries them (``Sample.rollout_routed_experts``).

The engine's routes of a sample's tokens, as SGLang reports them (`meta_info["routed_experts"]`: base64 of
int32 top-k expert ids, [tokens, layers, k] row-major), kept compact and JSON-safe as
``{"shape": [rows, width], "b64": str}``: row t holds token t's experts of every MoE layer (width =
layers * k, layer-major); rows cover the tokens that went through the engine, i.e. prompt + response - 1
(the final sampled token is never fed back). The trainer splits width into [layers, k]
(`relax.backends.megatron.routing_replay.rollout_routes_to_stage`).

A resumed (partial rollout) or continued (multi-turn) request sends the whole context again, so its routes
cover the earlier tokens too; `merge_routes` keeps the newest routes for the tokens they cover and the older
ones for tokens beyond (token order is preserved).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

__all__ = ["decode_routes", "encode_routes", "merge_routes", "routes_from_reply", "routes_rows"]


def encode_routes(routes: Any) -> dict[str, Any]:
    """{"shape": [rows, width], "b64": ...} of an int array [rows, ...] (trailing dims are flattened)."""
    arr = np.ascontiguousarray(np.asarray(routes), dtype="<i4")
    rows = int(arr.shape[0]) if arr.ndim else 0
    width = int(arr.size // rows) if rows else 0
    return {"shape": [rows, width], "b64": base64.b64encode(arr.tobytes()).decode("ascii")}


def decode_routes(data: dict[str, Any]) -> np.ndarray:
    """The int32 [rows, width] array of `encode_routes`' dict."""
    rows, width = (int(x) for x in data["shape"])
    flat = np.frombuffer(base64.b64decode(data["b64"]), dtype="<i4")
    if flat.size != rows * width:
        raise ValueError(f"routed experts: {flat.size} values for shape [{rows}, {width}]")
    return flat.reshape(rows, width).astype(np.int32)


def routes_rows(data: dict[str, Any] | None) -> int:
    return 0 if data is None else int(data["shape"][0])


def routes_from_reply(b64: str, rows: int) -> dict[str, Any]:
    """A Sample's routes from an SGLang reply's `meta_info["routed_experts"]` covering `rows` tokens."""
    flat = np.frombuffer(base64.b64decode(b64 or ""), dtype="<i4")
    if rows <= 0 or flat.size % rows:
        raise ValueError(f"routed experts: {flat.size} values do not split into {rows} tokens")
    return encode_routes(flat.reshape(rows, -1))


def merge_routes(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """`new` (covering the first rows of the context) followed by the rows of `old` beyond them."""
    if old is None or routes_rows(old) <= routes_rows(new):
        return new
    a, b = decode_routes(new), decode_routes(old)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"routed experts: {a.shape[1]} vs {b.shape[1]} values per token")
    return encode_routes(np.concatenate([a, b[a.shape[0]:]]))
