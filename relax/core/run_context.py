"""One run's roles and the bounded calls into them: what the loops, the stages and colocation receive.

The controller builds a `RunContext` (relax.core.controller: start-up, restarts, shutdown) and hands it to
the synchronous loop, the fully-async loop (relax.core.async_loop), the step's tail (relax.core.step_tail)
and the stages (relax.core.stages, through the bound `trainers` / `trainer0` / `bounded` methods). Nothing
else holds a copy of a handle: after a restart of the Megatron roles the context's `workers` and `aux` are
the new ones for every reader.

Every call into a role is bounded (relax.core.deadlines): the trainer ranks and auxiliary roles within
--train-step-timeout, the data plane within the control deadline, the rollout manager by its own requests'
deadlines (waited for in short slices, so that signals act at once). `in_flight` lists the calls not known
to be finished, so that the shutdown never queues a stop request behind them.

The engines are the rollout manager's engine pool's (relax.rollout.engine_pool): `engine_urls()` asks it
each time, so an engine replaced or added at run time is the one a weight push or an error line names.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import ray

from relax.wire.engine_client import EngineClient
from relax.wire.handles import DeferredHandle
from relax.config.config import Config
from relax.core.calls import run_bounded, wait_all
from relax.core.deadlines import FLAGS, Call, Deadlines, RoleFailure
from relax.core.run_control import RunControl
from relax.observability.accounting import RunAccounting
from relax.observability.metrics_client import MetricsReporter

logger = logging.getLogger("relax")


class RunContext:
    def __init__(self, config: Config, attempt: int):
        self.config = config
        self.attempt = attempt  # --use-health-check: 0, then 1, 2, ... per restart (relax.core.health_restart)
        self.deadlines = Deadlines.from_config(config)
        # --exit-duration-in-mins, --exit-signal-handler, --iterations-to-skip (relax.core.run_control)
        self.run_control = RunControl(config, attempt)
        self.accounting = RunAccounting()  # where every sample went, step by step and for the whole run
        self.reporter = MetricsReporter.from_config(config)  # --use-metrics-service; a no-op otherwise
        self.metrics: Any = None  # the run's MetricsWriter (metrics.jsonl, TensorBoard, ClearML)
        self.health: Any = None  # --use-health-check: the attempt's HealthManager (relax.core.health)
        self.fault: Any = None  # a test's injected rank fault (relax.health_faults)
        self.workers: list[Any] = []  # the actor's trainer ranks
        self.worker_where: list[str | None] = []  # "host pid N" of each trainer rank, for error lines
        self.aux: Any = None  # the reference, teacher and critic (relax.core.roles.AuxRoles)
        self.rollout: Any = None  # the rollout manager actor (its engine pool, router, data source, rewards)
        self.data: Any = None  # the TransferQueue data plane (relax.data.plane.DataPlane)
        self.stages: Any = None  # the step's stages bound to these roles (relax.core.stages.Stages)
        self.colocate: Any = None  # the turns of engines and trainer ranks on shared devices (relax.core.colocate)
        self.start_step = 0  # the first step this attempt runs (a resumed checkpoint's)
        self.current_step: int | None = None  # the step under way (a restart clears its partition)
        self.in_flight: list[tuple[Any, Any]] = []  # (actor, ref) of the loop's calls not known to be finished
        # --fully-async: the rollout call that runs beside the training calls (relax.core.async_loop)
        self.in_flight_async: list[tuple[Any, Any]] = []

    # ------------------------------------------------------------------ facts of the run
    def eval_enabled(self) -> bool:
        c = self.config
        return bool(c.eval_interval) and bool(c.eval_prompt_data or c.eval_config)

    def pushes_after(self, step: int) -> bool:
        """Whether the weights go to the engines after step `step` (--update-weights-interval; never in the
        debug modes, which have no engines or no trainer)."""
        c = self.config
        return (step + 1) % c.update_weights_interval == 0 and not (c.debug_rollout_only or c.debug_train_only)

    def saves_after(self, step: int) -> bool:
        """The save rule: every --save-interval steps and after the last step, when --save is given."""
        c = self.config
        return bool(c.save) and bool((c.save_interval and (step + 1) % c.save_interval == 0)
                                     or step + 1 == c.num_rollout)

    def engine_urls(self) -> list[str]:
        """The engine pool's engines of the moment (none before the rollout side started, or without engines)."""
        if self.rollout is None or self.config.debug_train_only:
            return []
        return self.rollout_call("get_engine_urls", "engine addresses", None)

    # ------------------------------------------------------------------ calls with deadlines (relax.core.deadlines)
    def weight_source(self) -> DeferredHandle:
        """Trainer rank 0 (which keeps the pushed weights) as the engine pool's weight source, deferred: the
        rollout manager would import the trainer's module (Megatron) to receive its handle (relax.wire.handles)."""
        return DeferredHandle(self.workers[0])

    def wait(self, actors: list[Any], refs: list[Any], calls: list[Call], deadline_s: float | None,
             flag: str) -> list[Any]:
        self.in_flight = list(zip(actors, refs))
        results = wait_all(refs, calls, deadline_s=deadline_s, flag=flag)
        self.in_flight = []
        return results

    def trainers(self, method: str, action: str, step: int | None, *args: Any) -> list[Any]:
        """`method(*args)` on every trainer rank, within --train-step-timeout."""
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        self.fault_point("trainer", f"{method} {action}", step)
        calls = [Call("trainer", action, rank=r, address=self.where(r), step=step) for r in range(len(refs))]
        return self.wait(self.workers, refs, calls, self.deadlines.train_s, FLAGS["train"])

    def trainer0(self, method: str, action: str, step: int | None, *args: Any) -> Any:
        """`method(*args)` on trainer rank 0 alone (a stage that is not collective), within --train-step-timeout."""
        ref = getattr(self.workers[0], method).remote(*args)
        self.fault_point("trainer", f"{method} {action}", step)
        call = Call("trainer", action, rank=0, address=self.where(0), step=step)
        return self.wait(self.workers[:1], [ref], [call], self.deadlines.train_s, FLAGS["train"])[0]

    def where(self, rank: int) -> str | None:
        return self.worker_where[rank] if rank < len(self.worker_where) else None

    def rollout_call(self, method: str, action: str, step: int | None, *args: Any) -> Any:
        """The rollout role's `method(*args)`: no deadline of its own (each engine request and reward call it
        makes has one, --generate-timeout and --reward-timeout), but waited for in short slices (signals act at
        once). When generation failed, the engines that no longer answer are named too."""
        ref = getattr(self.rollout, method).remote(*args)
        self.fault_point("rollout", f"{method} {action}", step)
        try:
            return self.wait([self.rollout], [ref], [Call("rollout", action, step=step)], None, "")[0]
        except RoleFailure as exc:
            if "GenerationError" in str(exc):
                exc.add_detail(self.silent_engines())
            raise

    def bounded(self, role: str, action: str, step: int, fn: Callable[[], Any]) -> Any:
        """A driver-side call of an auxiliary role's stage, within --train-step-timeout."""
        self.fault_point(role, action, step)
        return run_bounded(fn, Call(role, action, step=step), deadline_s=self.deadlines.train_s, flag=FLAGS["train"])

    def data_call(self, action: str, step: int, fn: Callable[[int], Any]) -> Any:
        """`fn(step)` on the data plane, within the control deadline."""
        return run_bounded(lambda: fn(step), Call("data plane (storage units)", action, step=step),
                           deadline_s=self.deadlines.control_s, flag=FLAGS["control"])

    def colocation(self, action: str, step: int | None, fn: Callable[[], Any]) -> Any:
        """A colocation hook (relax.core.colocate), within --train-step-timeout; called directly when the run
        does not take turns on devices (every hook then returns at once)."""
        if not self.colocate.active:
            return fn()
        return run_bounded(fn, Call("colocation (engines and trainer ranks)", action, step=step),
                           deadline_s=self.deadlines.train_s, flag=FLAGS["train"])

    def fault_point(self, role: str, action: str, step: int | None) -> None:
        """A test's injected fault (RELAX_TEST_TRAINER_FAULT, relax.health_faults) fires at its call."""
        fault = self.fault
        if fault is None or not fault.matches(role, action, step, self.attempt):
            return
        where = self.health.pid_of(role, fault.rank) if self.health is not None else None
        if where is None and role == "trainer" and self.where(fault.rank):
            where = (int(self.where(fault.rank).rsplit(" ", 1)[1]), None)
        if where is None:
            logger.warning("test fault injection: no pid known for %s; not fired", fault.target)
            return
        fault.fire(where[0], self.attempt)

    def silent_engines(self) -> str:
        """Which engines do not answer /health within the control deadline (at most 5 s), as a clause."""
        wait_s = min(5.0, self.deadlines.control_s)
        try:  # the pool's list; the manager is alive (it reported the generation error)
            urls = ray.get(self.rollout.get_engine_urls.remote(), timeout=wait_s)
        except Exception:
            return ""
        if not urls:
            return ""

        def healthy(url: str) -> bool:
            client = EngineClient(url, timeout_s=wait_s)
            try:
                return client.health(timeout_s=wait_s)
            finally:
                client.close()

        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            answers = list(pool.map(healthy, urls))
        silent = [u for u, ok in zip(urls, answers) if not ok]
        if not silent:
            return ""
        return f"engine {', '.join(silent)} does not answer /health within {wait_s:g} s"

    def busy_actors(self) -> set[int]:
        """Actors (by id of their handle) with a call of the loop that has not finished."""
        busy = set()
        for actor, ref in self.in_flight + self.in_flight_async:
            try:
                done, _ = ray.wait([ref], timeout=0)
            except Exception:
                done = []
            if not done:
                busy.add(id(actor))
        return busy

    # ------------------------------------------------------------------ metrics
    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        """Write the step's metrics; with --use-metrics-service they are the step's record there, merged from every
        role's reports (the controller's own values win over a role's of the same name)."""
        if self.reporter.enabled:
            self.reporter.report("controller", 0, metrics, step=step)
            record = self.reporter.step_record(step, expect=self._metrics_reporters())
            metrics = record["metrics"] if record else metrics
        self.metrics.log(step, metrics)

    def _metrics_reporters(self) -> dict[str, int]:
        """The roles that report each step to the metrics service, and how many ranks of each."""
        expect = {"controller": 1, "rollout": 1, "data": 1}  # generate runs every step (a replay with train-only)
        if not self.config.debug_rollout_only:
            expect["trainer"] = len(self.workers)
        return expect

    def evaluate_before_training(self) -> None:
        """The evaluation before the first step (unless --skip-eval-before-train), logged at the start step."""
        if self.eval_enabled() and not self.config.skip_eval_before_train:
            before = self.rollout_call("evaluate", "evaluation", self.start_step, self.start_step)
            self.metrics.log(self.start_step, {**before, "eval/before_train": 1.0})

    def summarize(self) -> None:
        """The run's sample accounting, logged once and written beside the metrics."""
        if self.accounting.steps:
            logger.info("%s (%s)", self.accounting.summary_line(), self.accounting.write(self.config.output_dir))
