"""The training thread's side of a step streamed in chunks (--num-iters-per-train-update K with --fully-async;
rules: relax.config.rules_streaming).

The rollout thread (relax.core.async_loop.AsyncLoop.generate) calls the rollout manager's
`generate(step, chunk, K)` for chunk 0 .. K-1 one after another; each call generates the next
--rollout-batch-size / K prompt groups, stores them in the step's partition (the indexes continue the run's
count, so a step holds the same indexes as an unchunked one) and hands the chunk's indexes to the window
(`StalenessWindow.chunk_finished`). The training thread, as soon as step N may train, takes each chunk as it
arrives, has the reference role write the chunk's `ref_logprobs` (with a KL loss or a KL reward), then has
every trainer rank run `train_chunk` on it (relax.training.streaming: old log-probs, advantages, forward and
backward passes, gradients accumulated); the last chunk's call makes the step's one optimizer step, and
--ref-update-interval's refresh follows it. Training of chunk 0 thus overlaps the generation of chunks 1 .. K-1. The step's rollout
metrics, weight push, checkpoint and accounting follow as for an unchunked step.

Metrics of each step (besides the trainer's, with `train/num_chunks`): `async/num_chunks`,
`async/first_chunk_train_start` (wall-clock time the training of chunk 0 started), `async/first_chunk_lead_time`
(`async/rollout_end` minus it: positive when training began while the rollout still ran) and
`async/chunk_wait_time` (seconds the training thread waited for chunks after the first one).
"""

from __future__ import annotations

import time
from typing import Any

from relax.core.run_context import RunContext
from relax.observability import timeline


def train_chunks(run: RunContext, window: Any, step: int, chunks: int) -> dict[str, float]:
    """Train step `step`'s chunks as the rollout stores them; returns the trainer's metrics of the step."""
    first = None
    waited = ref_time = 0.0
    metrics: dict[str, float] = {}
    for chunk in range(chunks):
        t_wait = time.time()
        stored = window.wait_chunk(step, chunk)
        if first is None:
            first = time.time()
        else:
            waited += time.time() - t_wait
        with timeline.span(f"reference chunk {chunk}", step=step, cat="train"):
            ref = run.stages.reference_chunk(step, stored["indexes"])
        ref_time += ref.get("perf/ref_logprob_time", 0.0)
        with timeline.span(f"train chunk {chunk}", step=step, cat="train"):
            out = run.trainers("train_chunk", f"train chunk {chunk}", step, step, chunk, chunks, stored["indexes"])
        if chunk + 1 == chunks:
            metrics = dict(out[0])
    metrics.update({"async/num_chunks": float(chunks), "async/first_chunk_train_start": first,
                    "async/chunk_wait_time": waited})
    if run.aux.reference is not None:
        metrics["perf/ref_logprob_time"] = ref_time
    with timeline.span("reference_refresh", step=step, cat="train"):  # --ref-update-interval, after the update
        metrics.update(run.stages.reference_refresh(step))
    return metrics
