"""A one-rank actor's step whose reference and later old-policy log-probs arrive while it trains.

With several optimizer steps per rollout (`--global-batch-size` below the step's samples), update u trains on
samples [u * gbs, (u + 1) * gbs) and needs their old-policy and reference log-probs only when it starts. The first
update's old-policy log-probs are the current ones: the weights have not moved since the rollout, so the loss
takes its own log-probs, detached (ratio 1, as with one update per rollout), and the rank computes no old-policy
rows before it. Its reference process (relax.roles.reference_process, with the policy's weights of the rollout)
computes, on the other core, the reference rows of the first update's samples, then the old-policy and reference
rows of each later update's, in the order the updates need them (`parts_for`). Before, the rank computed every
old-policy row before its first update while the other core finished the reference rows and then idled through
the updates.

The rows are the ones a pass over all samples gives: each part is whole micro-batches of that pass (a part
starts at a multiple of the micro-batch size, so it is cut into the same micro-batches) on the same weights and
code, and a forward pass does not depend on the other micro-batches. The first update's own log-probs equal its
old-policy pass's, bitwise on CPU (the same kernels with or without autograd; the recorded runs of
tests/recorded_runs.py hold that). Dynamic batch size (`--use-dynamic-batch-size`) groups samples by a token
budget from the first sample: parts cut at update boundaries can group them otherwise, which changes float
rounding, not the values' meaning.

`StepPasses.rows(kind)` is the rows of one kind as a sequence whose items wait for their part (`StreamedRows`);
the update reads them update by update (relax.training.step.update_stage)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from relax.roles.reference_process import POLICY, REFERENCE, ReferenceProcess


def parts_for(samples: int, gbs: int, with_old: bool) -> list[tuple[str, int, int]]:
    """The parts of a step of `samples` samples trained `gbs` at a time, in the order the updates need them: the
    reference rows of the first update's samples, then for each later update its old-policy rows (`with_old`) and
    its reference rows. The last part runs to the end (samples past the last whole update are never trained on
    but get rows, as in a pass over all of them)."""
    updates = max(1, samples // gbs) if gbs > 0 else 1
    bounds = [u * gbs for u in range(updates)] + [samples]
    parts: list[tuple[str, int, int]] = [(REFERENCE, bounds[0], bounds[1])]
    for lo, hi in zip(bounds[1:-1], bounds[2:]):
        if with_old:
            parts.append((POLICY, lo, hi))
        parts.append((REFERENCE, lo, hi))
    return [p for p in parts if p[2] > p[1]]


class StreamedRows(Sequence):
    """The rows of one kind of a step, in sample order; an item not received yet waits for its part."""

    def __init__(self, passes: "StepPasses", kind: str):
        self._passes = passes
        self._kind = kind

    def __len__(self) -> int:
        return len(self._passes.received[self._kind])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self._kind == POLICY and 0 <= i < self._passes.current_old:
            return None  # the first update's: its own log-probs (relax.training.objective: absent -> current)
        rows = self._passes.received[self._kind]
        while rows[i] is None:
            self._passes.pull()
        return rows[i]


class StepPasses:
    """The parts of one step asked of the reference process (`start`), received as the update needs them."""

    def __init__(self, process: ReferenceProcess, step: int, samples: int, parts: list[tuple[str, int, int]],
                 called: float):
        self.process = process
        self.step = step
        self.parts = parts
        self.called = called
        self.received: dict[str, list[torch.Tensor | None]] = {REFERENCE: [None] * samples}
        # old-policy rows: the samples before the first POLICY part are the first update's (none asked)
        self.current_old = 0
        if any(kind == POLICY for kind, _, _ in parts):
            self.received[POLICY] = [None] * samples
            self.current_old = min(lo for kind, lo, _ in parts if kind == POLICY)
        self._left = len(parts)
        self.spans: list[tuple[str, float, float]] = []  # (kind, start, end) of each part, the child's clock
        self.waited = 0.0  # seconds the rank waited for parts
        self.actor_start: float | None = None  # when the actor's forward stage began (perf/ref_overlap_time)

    @classmethod
    def start(cls, process: ReferenceProcess, step: int, sequences: list[list[int]], response_lengths: list[int],
              temperature: float, gbs: int, with_old: bool, policy: Any = None) -> "StepPasses":
        called = time.perf_counter()
        parts = parts_for(len(sequences), gbs, with_old)
        process.start(sequences, response_lengths, temperature, parts=parts, policy=policy if with_old else None)
        return cls(process, step, len(sequences), parts, called)

    @property
    def streams_old(self) -> bool:
        return POLICY in self.received

    def rows(self, kind: str) -> StreamedRows:
        return StreamedRows(self, kind)

    def pull(self) -> None:
        """Receive the next part (waiting for it)."""
        if self._left <= 0:
            raise RuntimeError(f"step {self.step}: the reference process answered every part, and a row is missing")
        t0 = time.perf_counter()
        part = self.process.next_part()
        self.waited += time.perf_counter() - t0
        self._left -= 1
        self.received[part.kind][part.lo:part.hi] = part.rows
        self.spans.append((part.kind, part.start, part.end))

    def finish(self) -> dict[str, float]:
        """Receive what is left. Metrics: perf/ref_logprob_time (from the stage's call to the last reference part's
        end), perf/ref_wait_time (how long the rank waited for parts) and perf/ref_overlap_time (how long the
        process computed while the actor's forward pass and updates ran)."""
        while self._left > 0:
            self.pull()
        now = time.perf_counter()
        ends = [end for kind, _, end in self.spans if kind == REFERENCE]
        begin = self.actor_start if self.actor_start is not None else now
        overlap = sum(max(0.0, min(end, now) - max(start, begin)) for _, start, end in self.spans)
        return {"perf/ref_logprob_time": max(ends) - self.called if ends else 0.0, "perf/ref_wait_time": self.waited,
                "perf/ref_overlap_time": overlap}

    def abandon(self) -> None:
        """The step failed: drop what is left, so that the process's next answers are the next request's."""
        self._left = 0
        self.process.drain()
