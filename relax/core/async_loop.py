"""Fully-async training (--fully-async, --max-staleness S): the rollout runs ahead of training, bounded.

The same stages as the synchronous loop (relax.core.stages, one implementation for both modes), run in three
threads of the driver instead of one after the other:

* the rollout thread calls the rollout manager's `generate(N)` for N = first step, N+1, ... one step at a time
  (the manager's data source and sample counter advance in step order), and starts step N only while
  N minus the oldest unconsumed step is at most S (`StalenessWindow`; S = 0 is strict alternation, which is
  the synchronous schedule);
* the passes thread takes each generated step in order and runs the stages of frozen models in roles of their
  own (`Stages.ahead`: the reference's and the teacher's log-probs) as soon as it is stored, so that step
  N+1's reference pass runs while step N trains (with S >= 1), and reads the step's sample count, weight
  versions and indexes from the data plane for its metrics, off the training thread;
* the training thread (the caller's) takes the oldest prepared step, runs its other stages (`Stages.plan`:
  critic values and old log-probs at once, advantages, updates), clears its partition, pushes the weights
  and only then marks the step consumed, which opens the window for the next rollout step.

Weight push while generation is in flight: every engine of the push is paused first
(`/pause_generation` mode "in_place": running requests freeze at a decode-step boundary and keep their
state), the weights are pushed (possibly several update requests) and generation continues
(`/continue_generation`), so that no decode step runs on a half-updated model. A response that spans a push
reports the engine's version at its end (SGLang's `meta_info.weight_version`), which is what
`Sample.weight_version` holds.

Metrics of each step, besides the synchronous ones:
* `async/staleness_mean`, `async/staleness_max`: the trainer's policy version when it trains step N (N: the
  trainer has made N updates; the push after step N carries version N+1) minus each sample's
  `weight_version`. At most S with --update-weights-interval 1 (a longer interval adds its lag).
* `async/queue_depth`: rollout steps started (running or finished) beyond the one being trained, when its
  stages end, before its weight push (0..S).
* `async/index_min`, `async/index_max`, `async/num_indexes`: the sample indexes the step trains (the run's
  accounting: consecutive steps tile the indexes, none twice).
* `async/rollout_start`, `async/rollout_end`, `async/train_start`, `async/train_end`: wall-clock times.
* `async/ahead_lead_time`: how long before the step's training began its reference / teacher passes ended
  (positive: they ran while an earlier step trained).

Checkpoints (--save): a checkpoint after step N holds the trainer after N+1 updates and the rollout position
as it was when step N's generation ended (kept by the rollout thread before it starts step N+1). Steps
generated beyond N when the checkpoint was taken are discarded on resume and deliberately generated again
from the same prompts: no sample is trained twice and none is lost.

Shutdown, SIGINT or an error in any stage: the training thread raises (the stage named by the controller's
bounded calls; a rollout failure as "rollout generate, step N"), the window stops, and the rollout thread
stops waiting for its running call (the controller's shutdown kills the actors; the call's ref is in
`RunContext.in_flight_async`, so the shutdown does not queue behind it).

Streaming chunks (--num-iters-per-train-update K > 1, relax.core.streaming): the rollout thread generates each
step in K chunks and hands each to the training thread as it is stored; the training thread starts step N as
soon as the window lets it (`run_window(..., streaming=True)`), trains each chunk as it arrives (gradients
accumulated, one optimizer step after the last) and then waits for the step's rollout result as above.

Colocation (--colocate) is refused with --fully-async by config validation: engines and trainer ranks that
share devices cannot run at the same time.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Any, Callable

import ray

from relax.core.calls import POLL_S
from relax.core.deadlines import Call, RoleFailure
from relax.core.run_context import RunContext
from relax.core.stages import run_group
from relax.core.step_tail import StepTimes, finish_step
from relax.core.streaming import train_chunks
from relax.observability import timeline

logger = logging.getLogger("relax")


class StalenessWindow:
    """Which rollout step may start, which step trains next (thread-safe; no Ray, so tests drive it directly).

    Steps `start` .. `stop - 1`. A step is *started* by the rollout, *finished* when its samples are stored, and
    *consumed* when its training and weight push are done. Step N may start only while
    N - (oldest unconsumed step) <= max_staleness."""

    def __init__(self, start: int, stop: int, max_staleness: int):
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        self.start, self.stop, self.max_staleness = start, stop, max_staleness
        self._cond = threading.Condition()
        self._oldest = start  # the oldest unconsumed step
        self._next = start  # the next step the rollout starts
        self._finished: dict[int, Any] = {}
        self._prepared: dict[int, Any] = {}  # results of the passes run ahead of training (run_window's prepare)
        self._chunks: dict[tuple[int, int], Any] = {}  # (step, chunk) -> a stored chunk (--num-iters-per-train-update)
        self._error: BaseException | None = None
        self._stopping = False

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def oldest_unconsumed(self) -> int:
        return self._oldest

    def may_start(self, step: int) -> bool:
        return step - self._oldest <= self.max_staleness

    def wait_to_start(self, step: int) -> bool:
        """Block until `step` may start (True) or the window stops (False)."""
        with self._cond:
            while not self._stopping and not self.may_start(step):
                self._cond.wait(POLL_S)
            if self._stopping:
                return False
            if step != self._next:
                raise RuntimeError(f"rollout step {step} started out of order (expected {self._next})")
            self._next = step + 1
            return True

    def finished(self, step: int, result: Any) -> None:
        with self._cond:
            self._finished[step] = result
            self._cond.notify_all()

    def failed(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def wait_finished(self, step: int) -> Any:
        """The result of step `step`'s rollout; raises the rollout's error. Waits in short slices, so that a
        signal interrupts it at once."""
        with self._cond:
            while step not in self._finished:
                if self._error is not None:
                    raise self._error
                if self._stopping:
                    raise RuntimeError("the async loop stopped")
                self._cond.wait(POLL_S)
            return self._finished.pop(step)

    def prepared(self, step: int, result: Any) -> None:
        """Step `step`'s passes that run ahead of training are done (`run_window`'s `prepare`)."""
        with self._cond:
            self._prepared[step] = result
            self._cond.notify_all()

    def wait_prepared(self, step: int) -> Any:
        """The result of `prepare` for step `step`; raises the rollout's or the passes' error."""
        with self._cond:
            while step not in self._prepared:
                if self._error is not None:
                    raise self._error
                if self._stopping:
                    raise RuntimeError("the async loop stopped")
                self._cond.wait(POLL_S)
            return self._prepared.pop(step)

    def chunk_finished(self, step: int, chunk: int, result: Any) -> None:
        with self._cond:
            self._chunks[(step, chunk)] = result
            self._cond.notify_all()

    def wait_chunk(self, step: int, chunk: int) -> Any:
        """Chunk `chunk` of step `step` once the rollout stored it; raises the rollout's error."""
        with self._cond:
            while (step, chunk) not in self._chunks:
                if self._error is not None:
                    raise self._error
                if self._stopping:
                    raise RuntimeError("the async loop stopped")
                self._cond.wait(POLL_S)
            return self._chunks.pop((step, chunk))

    def queue_depth(self) -> int:
        """Rollout steps started beyond the oldest unconsumed one."""
        with self._cond:
            return max(0, self._next - self._oldest - 1)

    def consumed(self, step: int) -> None:
        with self._cond:
            if step != self._oldest:
                raise RuntimeError(f"step {step} consumed out of order (oldest unconsumed {self._oldest})")
            self._oldest = step + 1
            self._cond.notify_all()

    def stop_all(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()


class _Stopped(Exception):
    """The window stopped while the rollout thread waited for its call."""


def run_window(window: StalenessWindow, generate: Callable[[int], Any], train: Callable[[int, Any], None],
               *, join_s: float = 5.0, streaming: bool = False,
               prepare: Callable[[int, Any], Any] | None = None) -> None:
    """Drive the window: a rollout thread calls `generate(step)` in step order within the bound, the caller's
    thread calls `train(step, result)` for each step in order and then marks it consumed. An error of any
    thread stops them all and is raised here (`generate` should poll `window.stopping` while it waits).
    `streaming`: `train(step, None)` is called as soon as the step may train, before its rollout has finished;
    it waits for the step's chunks (`wait_chunk`) and result (`wait_finished`) itself.
    `prepare`: a third thread takes each generated step in order, calls `prepare(step, result)` (the passes
    that may run while earlier steps train) and hands its return value to `train` instead of the rollout's."""

    def feed() -> None:
        try:
            for step in range(window.start, window.stop):
                if not window.wait_to_start(step):
                    return
                window.finished(step, generate(step))
        except _Stopped:
            return
        except BaseException as exc:  # handed to the training thread, which raises it
            window.failed(exc)

    def ahead() -> None:
        try:
            for step in range(window.start, window.stop):
                window.prepared(step, prepare(step, window.wait_finished(step)))
        except BaseException as exc:
            if not window.stopping:
                window.failed(exc)

    threads = [threading.Thread(target=feed, name="relax-async-rollout", daemon=True)]
    if prepare is not None and not streaming:
        threads.append(threading.Thread(target=ahead, name="relax-async-ahead", daemon=True))
    for thread in threads:
        thread.start()
    try:
        for step in range(window.start, window.stop):
            if streaming:
                result = None
            else:
                result = window.wait_prepared(step) if len(threads) > 1 else window.wait_finished(step)
            train(step, result)
            window.consumed(step)
    finally:
        window.stop_all()
        for thread in threads:
            thread.join(join_s)  # a call that does not stop is left to the shutdown (actors killed)


class AsyncLoop:
    """The fully-async loop (see the module docstring) over one run's roles, stages and bounded calls
    (relax.core.run_context); each trained step ends with the synchronous loop's tail (relax.core.step_tail)."""

    def __init__(self, run: RunContext):
        self.ctx = run
        self.c = run.config
        self.window = StalenessWindow(run.start_step, self.c.num_rollout, int(self.c.max_staleness))
        self.chunks = int(self.c.num_iters_per_train_update or 1)  # > 1: each step streams in chunks
        # the passes of frozen models in roles of their own run as soon as a step is generated, beside the
        # training of earlier steps (relax.core.stages.Stages.ahead); a streamed step trains as it arrives
        self.ahead = run.stages.ahead() if self.chunks == 1 else ()

    # ------------------------------------------------------------------ the rollout thread
    def generate(self, step: int) -> dict[str, Any]:
        run = self.ctx
        start = time.time()
        call = Call("rollout", "generate", step=step)
        try:
            if self.chunks == 1:
                metrics = self._rollout_call(run.rollout.generate.remote(step))
            else:  # each chunk stored goes to the training thread at once (relax.core.streaming)
                for chunk in range(self.chunks):
                    out = self._rollout_call(run.rollout.generate.remote(step, chunk, self.chunks))
                    self.window.chunk_finished(step, chunk, {"indexes": out["indexes"], "end": time.time()})
                metrics = out["metrics"]
            # the position after this step, before the next one starts: what a checkpoint after it holds
            state = ray.get(run.rollout.state_dict.remote()) if self.c.save else None
        except _Stopped:
            raise
        except Exception as exc:
            failure = RoleFailure(call, exc)
            if "GenerationError" in str(failure):
                failure.add_detail(run.silent_engines())
            raise failure from exc
        end = time.time()
        timeline.record("rollout", start, end, step=step, cat="rollout")
        return {"metrics": metrics, "state": state, "start": start, "end": end}

    def _rollout_call(self, ref: Any) -> Any:
        """The rollout role's call `ref`, waited for in short slices while the window runs."""
        run = self.ctx
        run.in_flight_async = [(run.rollout, ref)]
        while not ray.wait([ref], timeout=POLL_S)[0]:
            if self.window.stopping:  # the call stays in in_flight_async: the shutdown does not wait behind it
                raise _Stopped()
        run.in_flight_async = []
        return ray.get(ref)

    # ------------------------------------------------------------------ the passes ahead of training
    def prepare(self, step: int, rollout: dict[str, Any]) -> dict[str, Any]:
        """Step `step`'s `ahead` stages and its reads of the data plane (its sample count, weight versions and
        indexes), on their own thread (run_window's `prepare`), once its rollout is stored: none of them waits
        for the training of earlier steps, so the training thread does not wait for them either. Their metrics
        travel with the rollout's to the training thread."""
        metrics = run_group(self.ahead, step) if self.ahead else {}
        return {**rollout, "ahead": metrics, "ahead_end": time.time(), "stored": self._stored_metrics(step)}

    def _stored_metrics(self, step: int) -> dict[str, float]:
        run = self.ctx
        return {"data/step_samples": float(run.data_call("count the step's samples", step, run.data.size)),
                **run.data_call("read the step's weight versions", step, self._version_metrics)}

    # ------------------------------------------------------------------ the training thread
    def train(self, step: int, rollout: dict[str, Any] | None) -> None:
        run, c = self.ctx, self.c
        train_start = time.time()
        trained: dict[str, float] = {}
        if self.chunks > 1:  # rollout None: the step streams (run_window's `streaming`)
            trained = train_chunks(run, self.window, step, self.chunks)
            rollout = self.window.wait_finished(step)
            trained["async/first_chunk_lead_time"] = rollout["end"] - trained["async/first_chunk_train_start"]
        metrics = dict(rollout["metrics"])
        if self.ahead:  # > 0: the passes ended before this step's training began
            metrics.update(rollout["ahead"])
            metrics["async/ahead_lead_time"] = train_start - rollout["ahead_end"]
        metrics.update(rollout["stored"] if "stored" in rollout else self._stored_metrics(step))
        metrics.update(trained)
        if not c.debug_rollout_only and self.chunks == 1:
            for group in run.stages.plan(without=self.ahead):  # the synchronous loop's stages (relax.core.stages)
                metrics.update(run_group(group, step))
        # what the rollout had started beyond this step while it trained
        metrics["async/queue_depth"] = float(self.window.queue_depth())
        times = StepTimes(rollout["start"], rollout["end"], train_start, time.time())
        finish_step(run, step, metrics, times, trained=not c.debug_rollout_only,
                    rollout_state=lambda: rollout["state"])

    def _version_metrics(self, step: int) -> dict[str, float]:
        """Staleness of the step's samples against the trainer's version (`step` updates made) and the
        indexes it trains."""
        samples = self.ctx.data.get(step, fields=("weight_version",))
        if not samples:
            return {}
        lags = [step - int(s.weight_version) for s in samples]
        indexes = [int(s.index) for s in samples]
        return {"async/staleness_mean": statistics.fmean(lags), "async/staleness_max": float(max(lags)),
                "async/index_min": float(min(indexes)), "async/index_max": float(max(indexes)),
                "async/num_indexes": float(len(set(indexes)))}

    # ------------------------------------------------------------------ the whole loop
    def run(self) -> None:
        self.ctx.evaluate_before_training()
        logger.info("fully-async: rollout up to %d step(s) ahead of training", self.c.max_staleness)
        run_window(self.window, self.generate, self.train, streaming=self.chunks > 1, prepare=self.prepare)
        self.ctx.summarize()
