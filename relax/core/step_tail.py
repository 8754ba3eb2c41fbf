"""What follows a step's stages, in both loops: clear, push, save, perf metrics, evaluation, logging.

The synchronous loop (relax.core.controller) calls `finish_step` after each step's stages; the fully-async
training thread (relax.core.async_loop) after each trained step. In order:

1. the step's partition is cleared while the weights are pushed (the next step writes its own partition);
   the clear is waited for before the step ends, so a failure still names this step;
2. the weight push (every --update-weights-interval steps) to the engine pool's engines of the moment, a
   replaced or added engine too; with colocation the engines' weights are resident again first; in
   fully-async mode generation is in flight, so every engine of the push is paused in place first and
   continued after (also on failure), and no decode step runs on a half-updated model;
3. the save rule (`RunContext.saves_after`), with the rollout position of the step;
4. the perf metrics: rollout, train, weight-sync and save times, the step time from the rollout's start
   to the end of the save, tokens and samples per second;
5. colocation: the trainer offloads and the engines get their KV cache back;
6. evaluation every --eval-interval steps;
7. sample accounting, the step's metrics line, and its timeline span.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from relax.wire.engine_client import EngineClient
from relax.core.calls import run_bounded, start_bounded
from relax.core.checkpointing import save_checkpoint
from relax.core.deadlines import FLAGS, Call
from relax.core.run_context import RunContext
from relax.observability import timeline
from relax.observability.accounting import step_problems

logger = logging.getLogger("relax")


@dataclass
class StepTimes:
    """Wall-clock times (time.time()) of one step: its rollout, and its training up to the end of the stages."""
    rollout_start: float
    rollout_end: float
    train_start: float
    train_end: float


def finish_step(run: RunContext, step: int, metrics: dict[str, Any], times: StepTimes, *, trained: bool,
                rollout_state: Callable[[], Any]) -> bool:
    """The tail of step `step` (see the module docstring); `metrics` gains its entries and is logged.
    `trained`: the step's stages ran (not --debug-rollout-only, not an --iterations-to-skip step).
    `rollout_state()`: the rollout position a checkpoint after this step holds. Returns whether it saved."""
    c = run.config
    clearing = start_bounded(lambda: run.data.clear(step), Call("data plane (storage units)", "clear the step",
                                                                 step=step),
                             deadline_s=run.deadlines.control_s, flag=FLAGS["control"])
    sync_time = 0.0
    if run.pushes_after(step):
        t_push = time.time()
        # engines' weights back, KV cache still released
        metrics.update(run.colocation("resume engines' weights", step, lambda: run.colocate.before_sync(step)))
        with timeline.span("weight_push", step=step, cat="weights"):
            sync = push_weights(run, step, pause=c.fully_async)
        sync_time = time.time() - t_push
        metrics.update({"perf/weight_sync_bytes": float(sync["bytes"]),
                        "perf/weight_sync_bytes_per_s": sync["bytes_per_s"], "weights/version": float(step + 1)})
    clearing.wait()
    t_save = time.time()
    saved = run.saves_after(step)
    if saved:
        state = rollout_state()
        with timeline.span("save", step=step, cat="checkpoint"):
            run_bounded(lambda: save_checkpoint(c, run.workers, run.aux, state, step + 1),
                        Call("checkpoint", "save", step=step), deadline_s=run.deadlines.train_s, flag=FLAGS["train"])
    end = time.time()
    step_time = end - times.rollout_start
    metrics.update({
        "perf/rollout_time": times.rollout_end - times.rollout_start,
        "perf/train_time": times.train_end - times.train_start, "perf/weight_sync_time": sync_time,
        "perf/save_time": end - t_save, "perf/step_time": step_time,
        "perf/tokens_per_s": metrics.get("train/tokens", 0.0) / step_time,
        "perf/samples_per_s": metrics.get("rollout/num_samples", 0.0) / step_time,
    })
    if c.fully_async:  # when each side ran: the overlap of rollout and training, step by step
        metrics.update({"async/rollout_start": times.rollout_start, "async/rollout_end": times.rollout_end,
                        "async/train_start": times.train_start, "async/train_end": end})
    # trainer offloads, engines resume the KV cache
    metrics.update(run.colocation("offload trainer, resume engines", step, lambda: run.colocate.after_step(step)))
    if run.eval_enabled() and (step + 1) % c.eval_interval == 0:
        with timeline.span("evaluation", step=step, cat="rollout"):
            metrics.update(run.rollout_call("evaluate", "evaluation", step + 1, step + 1))
    run.accounting.add(metrics)
    for problem in step_problems(metrics, trained_expected=trained):
        logger.warning("step %d: sample accounting: %s", step, problem)
    run.log_step(step, metrics)  # with --use-metrics-service: merged with the roles' reports of the step
    # fully-async: the step's span is its training (its rollout has a span of its own, beside earlier steps')
    span_start = times.train_start if c.fully_async else times.rollout_start
    timeline.record(f"{'train ' if c.fully_async else ''}step {step}", span_start, time.time(), step=step,
                    cat="step")
    return saved


def push_weights(run: RunContext, step: int, pause: bool) -> dict[str, Any]:
    """Version step+1 of the weights to the pool's engines of the moment; returns rank 0's report. `pause`:
    generation may be in flight (fully-async), so each engine is paused in place first and continued after,
    also on failure."""
    urls = run.rollout_call("push_targets", "engines for the weight push", step)
    clients = [EngineClient(url, timeout_s=run.deadlines.control_s) for url in urls] if pause else []
    paused: list[EngineClient] = []
    try:
        for client in clients:
            run_bounded(lambda: client.pause("in_place"),
                        Call("rollout", f"pause generation on {client.base_url}", step=step),
                        deadline_s=run.deadlines.control_s, flag=FLAGS["control"])
            paused.append(client)
        reports = run.trainers("push_weights", "weight push", step, urls, step + 1,
                               run.config.update_weight_buffer_size)
        run.rollout_call("weights_pushed", "weight version", step, step + 1, urls)
    finally:
        for client in paused:
            try:
                run_bounded(client.resume, Call("rollout", f"continue generation on {client.base_url}", step=step),
                            deadline_s=run.deadlines.control_s, flag=FLAGS["control"])
            finally:
                client.close()
        for client in clients:
            if client not in paused:
                client.close()
    return reports[0]
