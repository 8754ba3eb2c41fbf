"""The controller: builds the roles as Ray actors and runs the synchronous RL loop.

One step is a list of stages (relax.core.stages), each reading its inputs from the step's TransferQueue
partition and writing its per-sample results back: rollout (engines behind the router) -> reference /
teacher log-probs, critic values, the actor's old log-probs -> advantages -> actor update (+ reference
refresh, critic update) -> partition cleared -> weights pushed to every engine (versioned, verified) ->
metrics -> checkpoint every --save-interval. `_loop` lists them in order. With --fully-async, `run` hands the
same stages to relax.core.async_loop (rollout ahead of training by at most --max-staleness steps).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relax.backends.auth import ENGINE_API_KEY_ENV, ensure_engine_api_key
from relax.backends.engine_client import EngineClient
from relax.config.config import Config
from relax.config.env import threads_per_process, worker_env
from relax.config.support_gpu import flight_recorder_env
from relax.core.async_loop import AsyncLoop
from relax.core.calls import (descendants, run_bounded, run_quietly, set_watch, start_bounded, stop_processes,
                              wait_all, wait_quietly)
from relax.core.deadlines import FLAGS, Call, Deadlines, RoleFailure
from relax.backends.megatron.checkpoint_layout import iter_dir
from relax.core.checkpointing import resume_from, save_checkpoint, wait_for_pending_save
from relax.core.colocate import ColocateProtocol
from relax.core.health import BOARD_META, MEGATRON_ROLES, HealthManager
from relax.core.health_restart import ATTEMPT_META, attempt_config
from relax.core.ray_cluster import start_ray
from relax.core.run_control import RunControl
from relax.core.placement import (cluster_has_gpus, colocated_bundles, create_placement_group, role_bundles,
                                  trainer_gpus)
from relax.core.roles import AuxRoles, build_aux_roles, launch_aux_groups
from relax.core.stages import Stages, run_group
from relax.data.plane import DataPlane
from relax.observability.accounting import RunAccounting, step_problems
from relax.observability import timeline
from relax.observability.metrics import MetricsWriter
from relax.observability.metrics_client import MetricsReporter
from relax.observability.metrics_service import start_metrics_service, stop_metrics_service
from relax.roles.engine import launch_rollout_engines
from relax.roles.rollout import RolloutManager
from relax.roles.trainer import TrainerWorker
from relax.weights.shm import sweep_stale_segments

logger = logging.getLogger("relax")
TIMELINE_MERGE_EVERY = 10  # steps between rewrites of --timeline-dump-dir's trace (each rewrite reads every span)
trace_log = logging.getLogger("relax.trace")  # tracebacks: the run's log file only (see run_controller)


class Controller:
    def __init__(self, config: Config, earlier_children: set[int] | None = None):
        if config.use_health_check and BOARD_META not in config.meta:  # the heartbeat board the ranks report to
            config = attempt_config(config, 0, config.load)
        self.config = config
        self.attempt = config.meta.get(ATTEMPT_META, 0)  # --use-health-check: 0, then 1, 2, ... per restart
        self.started = False  # start() completed
        self.health = None  # --use-health-check: the HealthManager of this attempt (relax.core.health)
        self.fault = None  # a test's injected rank fault (relax.core.health_faults), set by run_controller
        self._shut = ""  # "" | "kept ray" (torn down for a restart) | "all"
        timeline.set_role("controller")  # this process's track in --timeline-dump-dir's trace
        self.started_ray = False
        self.data = None
        self.workers: list[Any] = []
        self.rollout = None
        # (actor, ref of its start) of the rollout engines begun before the rollout manager took them over; the
        # driver owns these actors, so the shutdown kills them too
        self._launched_engines: list[tuple[Any, Any]] | None = None
        self.placement_groups: list[Any] = []
        self.metrics = None
        self.metrics_service = None  # the --use-metrics-service actor (relax.observability.metrics_service)
        self.reporter = MetricsReporter.from_config(config)
        self.engine_urls: list[str] = []
        self.start_step = 0
        self.current_step: int | None = None  # the synchronous loop's step under way
        self.aux = None
        self.stages = None
        self.colocate = None
        self.deadlines = Deadlines.from_config(config)
        # --exit-duration-in-mins, --exit-signal-handler, --iterations-to-skip (relax.core.run_control)
        self.run_control = RunControl(config, self.attempt)
        self.accounting = RunAccounting()  # where every sample went, step by step and for the whole run
        self.worker_where: list[str | None] = []  # "host pid N" of each trainer rank, for error lines
        self._in_flight: list[tuple[Any, Any]] = []  # (actor, ref) of calls not known to be finished
        # --fully-async: the rollout call that runs beside the training calls (relax.core.async_loop)
        self._in_flight_async: list[tuple[Any, Any]] = []
        # Processes this one had started before the run (e.g. a test's servers): the shutdown leaves them alone.
        # `earlier_children`: when Ray was started before this object (relax.core.run), those known before that.
        self._earlier_children = earlier_children if earlier_children is not None else {p.pid for p in descendants()}

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        c = self.config
        # One secret per run guards every engine's control endpoints; roles receive it in their environment.
        engine_key = {ENGINE_API_KEY_ENV: ensure_engine_api_key()}
        if start_ray(c):
            self.started_ray = True
        if c.use_health_check:  # before the roles: every Megatron rank beats from its constructor on
            self.health = HealthManager(c)
            set_watch(self.health.watch)
        if c.use_metrics_service:  # before the roles, so that their first reports find it
            self.metrics_service, _ = start_metrics_service(c.output_dir)
        use_gpu = cluster_has_gpus()
        if c.colocate:  # engines and trainer ranks on the same bundles (devices), taking turns
            pg_actor = pg_rollout = create_placement_group(colocated_bundles(c, use_gpu), "relax-colocate")
        else:
            pg_actor = create_placement_group(role_bundles(c, "actor", use_gpu), "relax-actor")
            pg_rollout = create_placement_group(role_bundles(c, "rollout", use_gpu), "relax-rollout")
        self.placement_groups = list({id(pg): pg for pg in (pg_actor, pg_rollout) if pg is not None}.values())

        # Start-up overlaps: every role's actors are created first (each a process that imports torch, Megatron
        # or SGLang for seconds), then TransferQueue starts while they import, and only then does the
        # controller wait for each role in turn. Nothing reads the data plane before its setup call.
        self._pg_actor, self._use_gpu, self._engine_key = pg_actor, use_gpu, engine_key
        self.workers = self._create_trainers()
        # The rollout side (manager, engines, router) is independent of the trainer until the first weight push.
        # Colocated roles share devices, so on GPUs there the engines start after the trainer has taken its
        # memory; on CPU there is no device memory to share, and they start beside the trainer as otherwise.
        engines_early = not c.debug_train_only and (not c.colocate or not use_gpu)
        if engines_early and not c.rollout_external:
            # begun here, not by the rollout manager: see relax.roles.engine.launch_rollout_engines
            self._launched_engines = launch_rollout_engines(c, pg_rollout)
        launched_aux = launch_aux_groups(c, use_gpu=use_gpu)
        # held from now on, so that a failing start-up shuts them down too
        self.aux = AuxRoles(c, launched_aux.get("reference"), critic=launched_aux.get("critic"),
                            teacher=launched_aux.get("teacher"))
        self.rollout = RolloutManager.options(num_cpus=1, runtime_env={"env_vars": {**worker_env(), **engine_key}}).remote(c)
        engines_ref = None
        if engines_early:
            engines_ref = self.rollout.start_engines.remote(pg_rollout, weight_source=self.workers[0],
                                                            launched=self._launched_engines)
        capacity = c.rollout_batch_size * (c.max_staleness + 1) * c.n_samples_per_prompt
        # "packed" moves each sample as one record: 3-5x faster than one message part per field.
        self.data = DataPlane.start(c.num_data_storage_units, capacity_samples=capacity,
                                    polling_mode=c.polling_mode, layout="packed")
        if self.health is not None:  # actors without heartbeats of their own: probed instead
            self.health.watch_actors({**self.data.actors(), **({"metrics service": self.metrics_service}
                                                                 if self.metrics_service is not None else {})})
        self._setup_trainers()
        self.aux = build_aux_roles(c, use_gpu=use_gpu, data_plane=self.data, launched=launched_aux)
        self.stages = Stages(c, self.aux, trainers=self._trainers, trainer0=self._trainer0, bounded=self._bounded)
        if not c.debug_train_only:  # train-only debugging replays saved rollouts: no engines
            if engines_ref is None:
                engines_ref = self.rollout.start_engines.remote(pg_rollout, weight_source=self.workers[0])
            self.engine_urls = self._wait([self.rollout], [engines_ref],
                                          [Call("rollout", "engine and router start")], None, "")[0]
            logger.info("rollout: %d engine(s) behind %s", len(self.engine_urls),
                        self._rollout_call("router_url", "router address", None))
        self.metrics = MetricsWriter.from_config(c)
        if c.load or c.pretrained_checkpoint:  # bounded like a save: a rank stuck reading it ends the run by name
            source = c.load or c.pretrained_checkpoint
            run_bounded(lambda: self._resume(c.load), Call("checkpoint", f"resume from {source}"),
                        deadline_s=self.deadlines.train_s, flag=FLAGS["train"])
        self.colocate = ColocateProtocol(c, self.workers, self.engine_urls, rollout=self.rollout)
        self.started = True

    def _create_trainers(self) -> list[Any]:
        """The trainer ranks' actors, one per bundle of the actor placement group (created, not yet set up)."""
        c = self.config
        actor_world = c.actor_world_size
        train_env = {"env_vars": {**flight_recorder_env(c), **worker_env(c.train_env_vars, training_role=True),
                                  **self._engine_key}}
        return [
            TrainerWorker.options(num_cpus=1, num_gpus=trainer_gpus(c, self._use_gpu), runtime_env=train_env,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(
                                      placement_group=self._pg_actor, placement_group_bundle_index=rank)
                                  ).remote(c, rank, actor_world, threads_per_process(actor_world))
            for rank in range(actor_world)
        ]

    def _setup_trainers(self) -> None:
        """Wait for the trainer ranks' processes and build their models (one torch.distributed group)."""
        c = self.config
        master_addr, master_port = wait_all([self.workers[0].master_address.remote()],
                                            [Call("trainer", "start", rank=0)],  # the actor's creation, too
                                            deadline_s=self.deadlines.train_s, flag=FLAGS["train"])[0]
        backend = c.distributed_backend if self._use_gpu else "gloo"
        infos = self._trainers("setup", "setup", None, master_addr, master_port, backend)
        self.worker_where = [info.get("where") for info in infos]
        logger.info("trainer: %d rank(s), data-parallel %d, %d parameters", c.actor_world_size, infos[0]["dp"],
                    infos[0]["params"])

    def restart_megatron_roles(self, config: Config, load: str, failed_step: int | None) -> None:
        """--use-health-check, after a trainer, reference, teacher or critic rank failed in a synchronous run:
        replace those roles alone and resume them from `load`'s newest checkpoint, keeping Ray, the rollout
        manager with its engines and router, and the data plane (relax.core.health_restart chooses this before a
        restart of everything). `config`: the next attempt's (resuming from `load`, same heartbeat board).

        The checkpoint restores the trainer, the saved auxiliary roles and the rollout position, and its weights
        go to the engines (relax.core.checkpointing.resume_from); the failed step's partition is cleared, so every
        sample id reaches training once."""
        set_watch(None)  # the failed ranks' old heartbeats must not end the restart's own waits
        if self.health is not None:
            self.health.kill_silent_ranks()  # a SIGSTOPped rank cannot act on Ray's kill
        aux_actors, aux_groups = self._aux_handles()
        for actor in self.workers + aux_actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        for pg in aux_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        if self.health is not None:
            self.health.forget(MEGATRON_ROLES)
            set_watch(self.health.watch)
        self.config, self.attempt = config, config.meta.get(ATTEMPT_META, self.attempt + 1)
        self.run_control = RunControl(config, self.attempt)
        if failed_step is not None:  # the one partition still stored: every earlier step's clear was waited for
            self._data_call("clear the failed step", failed_step, self.data.clear)
        self.workers = self._create_trainers()
        launched_aux = launch_aux_groups(config, use_gpu=self._use_gpu)
        self.aux = AuxRoles(config, launched_aux.get("reference"), critic=launched_aux.get("critic"),
                            teacher=launched_aux.get("teacher"))
        self._setup_trainers()
        self.aux = build_aux_roles(config, use_gpu=self._use_gpu, data_plane=self.data, launched=launched_aux)
        self.stages = Stages(config, self.aux, trainers=self._trainers, trainer0=self._trainer0,
                             bounded=self._bounded)
        if self.metrics is not None:  # metrics.jsonl was rewritten without the steps done again: append to it
            self.metrics.close()
        self.metrics = MetricsWriter.from_config(config)
        run_bounded(lambda: self._resume(load), Call("checkpoint", f"resume from {load}"),
                    deadline_s=self.deadlines.train_s, flag=FLAGS["train"])
        # the pool's record of the engines' weights: the checkpoint's, as pushed
        self._rollout_call("weights_pushed", "weight version", None, self.start_step, self.engine_urls)
        self.colocate = ColocateProtocol(config, self.workers, self.engine_urls, rollout=self.rollout)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        self._colocate("start", None, self.colocate.start)  # --offload-train: room for the first rollout
        if self.config.fully_async:  # the same stages, rollout ahead of training by --max-staleness steps
            AsyncLoop(self).run()
        else:
            with self.run_control.signal_handler():
                self._loop()
        # everything resident again for the final checks; after a failure the shutdown kills it all anyway
        self._colocate("finish", None, self.colocate.finish)

    def _loop(self) -> None:
        c = self.config
        if self._eval_enabled() and not c.skip_eval_before_train:
            before = self._rollout_call("evaluate", "evaluation", self.start_step, self.start_step)
            self.metrics.log(self.start_step, {**before, "eval/before_train": 1.0})
        for step in range(self.start_step, c.num_rollout):
            self.current_step = step  # a restart of the Megatron roles clears the partitions up to it
            t0 = time.perf_counter()
            step_start = time.time()  # the timeline's step span (wall clock, like every role's spans)
            with timeline.span("rollout", step=step, cat="rollout"):
                metrics = self._rollout_call("generate", "generate", step, step)
            t1 = time.perf_counter()
            # what went through TransferQueue
            metrics["data/step_samples"] = float(self._data_call("count the step's samples", step, self.data.size))
            will_sync = (step + 1) % c.update_weights_interval == 0 and not (c.debug_rollout_only
                                                                            or c.debug_train_only)
            skipped = self.run_control.skips(step)  # --iterations-to-skip: rolled out, not trained
            if skipped:
                metrics["train/skipped_iteration"] = 1.0
                logger.info("step %d: skipped (--iterations-to-skip %d): rolled out, not trained", step, step + 1)
            if not c.debug_rollout_only:
                # engines release, trainer reloads
                metrics.update(self._colocate("release engines, reload trainer", step,
                                              lambda: self.colocate.before_train(step, will_sync)))
                # the step's stages, each writing its per-sample rows into the step's partition (relax.core.stages:
                # ref_logprobs, teacher_logprobs, values and old_logprobs at once; then advantages and returns;
                # the update; the reference refresh every --ref-update-interval steps; the critic's update)
                for group in self.stages.plan() if not skipped else ():
                    metrics.update(run_group(group, step))
            t2 = time.perf_counter()
            # the step's partition is freed while the weights are pushed (the next step writes its own partition);
            # waited for before the step ends, so a failure still names this step
            clearing = start_bounded(lambda: self.data.clear(step), Call("data plane (storage units)", "clear the step",
                                                                         step=step),
                                     deadline_s=self.deadlines.control_s, flag=FLAGS["control"])
            sync_time = 0.0
            if will_sync:
                # engines' weights back, KV cache still released
                metrics.update(self._colocate("resume engines' weights", step, lambda: self.colocate.before_sync(step)))
                with timeline.span("weight_push", step=step, cat="weights"):
                    # the pool's engines of the moment (a replaced or added engine too), not those of the start
                    self.engine_urls = self._rollout_call("push_targets", "engines for the weight push", step)
                    reports = self._trainers("push_weights", "weight push", step, self.engine_urls, step + 1,
                                             c.update_weight_buffer_size)
                    self._rollout_call("weights_pushed", "weight version", step, step + 1, self.engine_urls)
                sync = reports[0]
                sync_time = time.perf_counter() - t2
                metrics.update({"perf/weight_sync_bytes": float(sync["bytes"]),
                                "perf/weight_sync_bytes_per_s": sync["bytes_per_s"],
                                "weights/version": float(step + 1)})
            clearing.wait()
            t3 = time.perf_counter()
            saved = c.save and ((c.save_interval and (step + 1) % c.save_interval == 0) or step + 1 == c.num_rollout)
            if saved:
                with timeline.span("save", step=step, cat="checkpoint"):
                    run_bounded(lambda: self.save(step + 1), Call("checkpoint", "save", step=step),
                                deadline_s=self.deadlines.train_s, flag=FLAGS["train"])
            step_time = time.perf_counter() - t0
            metrics.update({
                "perf/rollout_time": t1 - t0, "perf/train_time": t2 - t1, "perf/weight_sync_time": sync_time,
                "perf/save_time": time.perf_counter() - t3, "perf/step_time": step_time,
                "perf/tokens_per_s": metrics.get("train/tokens", 0.0) / step_time,
                "perf/samples_per_s": metrics.get("rollout/num_samples", 0.0) / step_time,
            })
            # trainer offloads, engines resume the KV cache
            metrics.update(self._colocate("offload trainer, resume engines", step,
                                          lambda: self.colocate.after_step(step)))
            if self._eval_enabled() and (step + 1) % c.eval_interval == 0:
                with timeline.span("evaluation", step=step, cat="rollout"):
                    metrics.update(self._rollout_call("evaluate", "evaluation", step + 1, step + 1))
            self.accounting.add(metrics)
            for problem in step_problems(metrics, trained_expected=not (c.debug_rollout_only or skipped)):
                logger.warning("step %d: sample accounting: %s", step, problem)
            self.log_step(step, metrics)
            timeline.record(f"step {step}", step_start, time.time(), step=step, cat="step")
            if c.timeline_dump_dir and (step + 1 - self.start_step) % TIMELINE_MERGE_EVERY == 0:
                timeline.merge(c.timeline_dump_dir)  # a run stopped later still leaves the steps so far
            if step + 1 < c.num_rollout and self._stop_early(step, bool(saved)):
                break
        if self.accounting.steps:
            logger.info("%s (%s)", self.accounting.summary_line(), self.accounting.write(c.output_dir))

    def _stop_early(self, step: int, saved: bool) -> bool:
        """--exit-duration-in-mins / --exit-signal-handler (relax.core.run_control): after step `step`, save (unless
        this step was saved) and say why the run stops here."""
        reason = self.run_control.stop_reason()
        if reason is None:
            return False
        path = None
        if self.config.save:
            final = (lambda: wait_for_pending_save(self)) if saved else (lambda: save_checkpoint(self, step + 1, True))
            run_bounded(final, Call("checkpoint", "save before stopping", step=step), deadline_s=self.deadlines.train_s,
                        flag=FLAGS["train"])
            path = iter_dir(self.config.save, step + 1)
        self.run_control.stopped = self.run_control.stop_line(reason, step + 1, self.config.num_rollout, path)
        logger.warning("%s", self.run_control.stopped)
        return True

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

    def _eval_enabled(self) -> bool:
        c = self.config
        return bool(c.eval_interval) and bool(c.eval_prompt_data or c.eval_config)

    # ------------------------------------------------------------------ calls with deadlines (relax.core.deadlines)
    def _wait(self, actors: list[Any], refs: list[Any], calls: list[Call], deadline_s: float | None,
              flag: str) -> list[Any]:
        self._in_flight = list(zip(actors, refs))
        results = wait_all(refs, calls, deadline_s=deadline_s, flag=flag)
        self._in_flight = []
        return results

    def _trainers(self, method: str, action: str, step: int | None, *args: Any) -> list[Any]:
        """`method(*args)` on every trainer rank, within --train-step-timeout."""
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        self._fault_point("trainer", f"{method} {action}", step)
        calls = [Call("trainer", action, rank=r, address=self._where(r), step=step) for r in range(len(refs))]
        return self._wait(self.workers, refs, calls, self.deadlines.train_s, FLAGS["train"])

    def _trainer0(self, method: str, action: str, step: int | None, *args: Any) -> Any:
        """`method(*args)` on trainer rank 0 alone (a stage that is not collective), within --train-step-timeout."""
        ref = getattr(self.workers[0], method).remote(*args)
        self._fault_point("trainer", f"{method} {action}", step)
        call = Call("trainer", action, rank=0, address=self._where(0), step=step)
        return self._wait(self.workers[:1], [ref], [call], self.deadlines.train_s, FLAGS["train"])[0]

    def _where(self, rank: int) -> str | None:
        return self.worker_where[rank] if rank < len(self.worker_where) else None

    def _fault_point(self, role: str, action: str, step: int | None) -> None:
        """A test's injected fault (RELAX_TEST_TRAINER_FAULT, relax.core.health_faults) fires at its call."""
        fault = self.fault
        if fault is None or not fault.matches(role, action, step, self.attempt):
            return
        where = self.health.pid_of(role, fault.rank) if self.health is not None else None
        if where is None and role == "trainer" and self._where(fault.rank):
            where = (int(self._where(fault.rank).rsplit(" ", 1)[1]), None)
        if where is None:
            logger.warning("test fault injection: no pid known for %s; not fired", fault.target)
            return
        fault.fire(where[0], self.attempt)

    def _rollout_call(self, method: str, action: str, step: int | None, *args: Any) -> Any:
        """The rollout role's step: no deadline of its own (each engine request and reward call it makes has
        one, --generate-timeout and --reward-timeout), but waited for in short slices (signals act at once).
        When generation failed, the engines that no longer answer are named too."""
        ref = getattr(self.rollout, method).remote(*args)
        self._fault_point("rollout", f"{method} {action}", step)
        try:
            return self._wait([self.rollout], [ref], [Call("rollout", action, step=step)], None, "")[0]
        except RoleFailure as exc:
            if "GenerationError" in str(exc):
                exc.add_detail(self._silent_engines())
            raise

    def _silent_engines(self) -> str:
        """Which engines do not answer /health within the control deadline (at most 5 s), as a clause."""
        if not self.engine_urls:
            return ""
        wait_s = min(5.0, self.deadlines.control_s)

        def healthy(url: str) -> bool:
            client = EngineClient(url, timeout_s=wait_s)
            try:
                return client.health(timeout_s=wait_s)
            finally:
                client.close()

        with ThreadPoolExecutor(max_workers=len(self.engine_urls)) as pool:
            answers = list(pool.map(healthy, self.engine_urls))
        silent = [u for u, ok in zip(self.engine_urls, answers) if not ok]
        if not silent:
            return ""
        return f"engine {', '.join(silent)} does not answer /health within {wait_s:g} s"

    def _bounded(self, role: str, action: str, step: int, fn: Any) -> Any:
        """A driver-side call of an auxiliary role's stage, within --train-step-timeout."""
        self._fault_point(role, action, step)
        return run_bounded(fn, Call(role, action, step=step), deadline_s=self.deadlines.train_s, flag=FLAGS["train"])

    def _data_call(self, action: str, step: int, fn: Any) -> Any:
        return run_bounded(lambda: fn(step), Call("data plane (storage units)", action, step=step),
                           deadline_s=self.deadlines.control_s, flag=FLAGS["control"])

    def _colocate(self, action: str, step: int | None, fn: Any) -> Any:
        if not self.colocate.active:
            return fn()  # nothing to call: every hook returns at once
        return run_bounded(fn, Call("colocation (engines and trainer ranks)", action, step=step),
                           deadline_s=self.deadlines.train_s, flag=FLAGS["train"])

    # ------------------------------------------------------------------ checkpoints
    def save(self, rollout_id: int) -> Path:
        return save_checkpoint(self, rollout_id)

    def _resume(self, load: str) -> None:
        resume_from(self, load)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, keep_ray: bool = False) -> None:
        """Stop everything within bounded waits; never wait behind a stuck call.

        Idle roles are asked to stop, all at once, for up to `Deadlines.shutdown_s`; a role still busy with a
        call (a reward that never returns, a push to a stopped engine) is not asked, since its request would
        queue behind that call. Then every actor is killed, the data plane and Ray are stopped, any process
        the run started that is still there (a SIGSTOPped engine cannot act on its parent's death) is
        signalled, and weight-sync segments whose writer is gone are removed from /dev/shm. `keep_ray`: a
        restart (relax.core.health_restart) tears the attempt down but keeps Ray and its processes."""
        if self._shut:  # torn down already; after a restart's teardown (Ray kept) an interrupted restart stops Ray
            if self._shut == "kept ray" and not keep_ray and self.started_ray and ray.is_initialized():
                ray.shutdown()
            return
        self._shut = "kept ray" if keep_ray else "all"
        set_watch(None)  # the shutdown's own waits are bounded; a silent rank is killed below, not reported
        grace = self.deadlines.shutdown_s
        started = ([p for p in descendants() if p.pid not in self._earlier_children]
                   if self.started_ray and not keep_ray else [])
        if self.health is not None:  # a SIGSTOPped rank cannot act on Ray's kill: SIGKILL it first
            killed = self.health.kill_silent_ranks()
            if killed:
                trace_log.warning("shutdown: killed silent rank process(es) %s", killed)
        busy = self._busy_actors()
        aux_actors, aux_groups = self._aux_handles()
        aux_stop = None
        if self.aux is not None:
            aux_stop = threading.Thread(target=self._stop_aux, name="relax-stop-aux", daemon=True)
            aux_stop.start()
        t0 = time.monotonic()
        stops = [self.rollout.shutdown.remote()] if self.rollout is not None and id(self.rollout) not in busy else []
        stops += [w.shutdown.remote() for w in self.workers if id(w) not in busy]
        wait_quietly(stops, grace)
        if aux_stop is not None:
            aux_stop.join(max(0.0, grace - (time.monotonic() - t0)))
        engines = [actor for actor, _ in self._launched_engines or []]
        for actor in self.workers + aux_actors + ([self.rollout] if self.rollout is not None else []) + engines:
            try:
                ray.kill(actor)
            except Exception:
                pass
        if self.metrics_service is not None:  # before Ray stops: the actor holds a share of a CPU
            run_quietly(lambda: stop_metrics_service(self.metrics_service), grace, "stop the metrics service")
        if self.data is not None:
            run_quietly(self.data.shutdown, grace, "stop the data plane")
        for pg in self.placement_groups + aux_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        if self.metrics is not None:
            self.metrics.close()
        if self.health is not None:
            self.health.close()
        if self.started_ray and not keep_ray and ray.is_initialized():
            ray.shutdown()
        left = stop_processes(started)
        if left:
            trace_log.warning("shutdown: signalled %d process(es) still running: %s", len(left), left)
        sweep_stale_segments()  # the trainer's /dev/shm segment, when its process was killed before closing it
        if self.config.timeline_dump_dir:  # every span the roles wrote, also after a failure
            try:
                path = timeline.merge(self.config.timeline_dump_dir)
                logger.info("timeline: %s (load it in ui.perfetto.dev or chrome://tracing)", path)
            except OSError as exc:
                logger.warning("timeline: could not write %s: %s", self.config.timeline_dump_dir, exc)

    def _busy_actors(self) -> set[int]:
        """Actors (by id of their handle) with a call of the loop that has not finished."""
        busy = set()
        for actor, ref in self._in_flight + self._in_flight_async:
            try:
                done, _ = ray.wait([ref], timeout=0)
            except Exception:
                done = []
            if not done:
                busy.add(id(actor))
        return busy

    def _aux_handles(self) -> tuple[list[Any], list[Any]]:
        """The auxiliary roles' actors and placement groups, to kill them if they do not stop in time."""
        groups = [getattr(self.aux, n, None) for n in ("reference", "teacher", "critic")]
        actors = [w for g in groups if g is not None for w in getattr(g, "workers", None) or []]
        pgs = [g.placement_group for g in groups if getattr(g, "placement_group", None) is not None]
        return actors, pgs

    def _stop_aux(self) -> None:
        try:
            self.aux.shutdown()
        except Exception as exc:
            trace_log.warning("auxiliary roles shutdown", exc_info=exc)
