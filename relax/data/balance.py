"""How the samples of one optimizer step are shared among the data-parallel ranks (--balance-data).

Pure functions, no torch. Every rank sees the whole step (the data plane hands each rank all of it), so
every rank computes the same assignment from the same lengths and takes its own part.

- `strided_shares`: the default, sample i goes to rank i mod dp.
- `karmarkar_karp`: the largest-differencing method for k-way partitioning (Karmarkar & Karp, 1982), as
  slime/verl use for `--balance-data`: with `equal_size` every rank gets the same number of samples (a fixed
  --micro-batch-size needs that) and the token totals are as even as the heuristic finds.
"""

from __future__ import annotations

import heapq
from typing import Sequence


def strided_shares(n: int, dp: int) -> list[list[int]]:
    return [list(range(r, n, dp)) for r in range(dp)]


class _State:
    """A partial solution: k parts (index lists and token sums), kept sorted by sum, largest first."""

    __slots__ = ("parts", "sums")

    def __init__(self, parts: list[list[int]], sums: list[int]):
        order = sorted(range(len(parts)), key=lambda i: (-sums[i], min(parts[i], default=-1)))
        self.parts = [parts[i] for i in order]
        self.sums = [sums[i] for i in order]

    @property
    def spread(self) -> int:
        return self.sums[0] - self.sums[-1]

    def merge(self, other: "_State") -> "_State":
        # the largest part of one with the smallest of the other: the differences cancel
        k = len(self.parts)
        parts = [self.parts[i] + other.parts[k - 1 - i] for i in range(k)]
        sums = [self.sums[i] + other.sums[k - 1 - i] for i in range(k)]
        return _State(parts, sums)


def karmarkar_karp(lengths: Sequence[int], k: int, equal_size: bool = True) -> list[list[int]]:
    """Partition the indexes of `lengths` into `k` parts with balanced sums (each part in ascending order).

    With `equal_size` the parts have exactly len(lengths) / k members (len must be divisible by k).
    Deterministic: ties are broken by index, so every rank gets the same answer.
    """
    n = len(lengths)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if equal_size and n % k:
        raise ValueError(f"{n} samples cannot be split into {k} parts of equal size")
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    states: list[_State] = []
    if equal_size:
        for start in range(0, n, k):
            chunk = order[start:start + k]
            states.append(_State([[i] for i in chunk], [int(lengths[i]) for i in chunk]))
    else:
        for i in order:
            states.append(_State([[i]] + [[] for _ in range(k - 1)], [int(lengths[i])] + [0] * (k - 1)))
    if not states:
        return [[] for _ in range(k)]
    heap = [(-s.spread, seq, s) for seq, s in enumerate(states)]
    heapq.heapify(heap)
    seq = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = a.merge(b)
        heapq.heappush(heap, (-merged.spread, seq, merged))
        seq += 1
    parts = [sorted(p) for p in heap[0][2].parts]
    return sorted(parts, key=lambda p: (p[0] if p else n))


def dp_shares(lengths: Sequence[int], dp: int, balance: bool) -> list[list[int]]:
    """Indexes each data-parallel rank trains on: balanced by tokens, or strided (the default)."""
    if not balance or dp <= 1:
        return strided_shares(len(lengths), dp)
    return karmarkar_karp(lengths, dp, equal_size=len(lengths) % dp == 0)


def token_spread(lengths: Sequence[int], shares: Sequence[Sequence[int]]) -> tuple[int, float]:
    """(max - min) of the ranks' token totals, and max / mean (1.0 is perfectly even)."""
    totals = [sum(int(lengths[i]) for i in share) for share in shares]
    mean = sum(totals) / max(len(totals), 1)
    return max(totals) - min(totals), (max(totals) / mean if mean else 1.0)
