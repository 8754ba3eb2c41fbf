"""Shared-prompt prefill: what SGLang's radix cache does for GRPO groups, within one admitted group.

A GRPO step sends every prompt n times (SGLang's `n`, or n requests with identical `input_ids`); prefilling
each copy on its own row repeats the same forward pass n times. Here the requests of a prefill group whose
`input_ids` are identical are prefilled once, on the row of the first of them (the group's left-padded layout
and its length stay those of the whole group), and the KV cache rows and the logits are then copied to every
copy (`expand`), so the running batch is laid out exactly as if each copy had been prefilled on its own row.
Prompt log-probs (`return_logprob` with `logprob_start_len >= 0`) and routed experts (R3) of a copy are read
from the row it shares: an identical prompt gives identical values.

Results: a copy's KV rows and first-token logits are bit-identical to those of its prompt's first request
(before, each copy's row came out of a larger matrix product and could differ from the others in the last
bits, ~1e-7); sampling stays per row (each copy draws with its own `sampling_seed` or from the engine's
generator in row order, as before), so greedy tokens and seeded tokens are those of the unshared prefill
except where float noise decided a near tie.

Nothing is kept across prefill groups (there is no radix tree to flush): only copies admitted together share.
Sharing is what the group's order and contents decide, never the timing, so the same admitted group always
prefills the same rows. `cached_tokens` in a reply (SGLang's prefix-cache hits) is the number of prompt tokens
a copy reused: its whole prompt (its last-position logits are reused too), 0 for the request whose row was
computed. Caches whose layers are not plain `DynamicLayer`s (sliding-window, hybrid) are not shared.
"""

from __future__ import annotations

from typing import Sequence

import torch


def plan(group: Sequence) -> list[int] | None:
    """For each request of `group`, the index of the prefill row it reads (rows numbered in order of first
    appearance of each distinct prompt), or None when every prompt of the group is distinct."""
    first: dict[tuple, int] = {}
    src: list[int] = []
    for r in group:
        key = (r.lora_name, *r.input_ids)  # the same prompt under another adapter (lora.py) is another row
        row = first.get(key)
        if row is None:
            row = first[key] = len(first)
        src.append(row)
    return None if len(first) == len(src) else src


def first_rows(src: list[int]) -> list[int]:
    """The positions in the group of the requests whose rows are prefilled: the first request of each distinct
    prompt, in row order."""
    reps: list[int] = []
    for i, row in enumerate(src):
        if row == len(reps):
            reps.append(i)
    return reps


def mark_cached(group: Sequence, src: list[int]) -> int:
    """Set `cached_tokens` of every copy (a request that reads a row computed for an earlier one) to its prompt
    length; returns the number of prompt tokens reused."""
    seen = -1
    reused = 0
    for r, row in zip(group, src):
        if row > seen:
            seen = row
            continue
        r.cached_tokens = len(r.input_ids)
        reused += len(r.input_ids)
    return reused


def expand(cache, logits: torch.Tensor, src: list[int]) -> torch.Tensor:
    """Copy the prefilled rows of `cache` (in place) and `logits` to one row per request (`src`)."""
    idx = torch.tensor(src, dtype=torch.long, device=logits.device)
    cache.batch_select_indices(idx)
    return logits.index_select(0, idx)
