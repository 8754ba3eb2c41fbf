"""The controller: builds the roles as Ray actors, runs the loop over them, restarts and stops them.

`start` builds one run's roles into its `RunContext` (relax.core.run_context): the trainer ranks, the
auxiliary roles, the rollout manager with its engine pool and router, the data plane. `_loop` is the
synchronous step: the rollout, the stages (relax.core.stages: reference / teacher log-probs, critic values and
the actor's old log-probs at once -> advantages -> updates), then the step's tail (relax.core.step_tail: clear,
weight push, save, perf metrics, evaluation, logging). With --fully-async, `run` hands the same context to
relax.core.async_loop, whose training thread runs the same stages and the same tail.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relax.wire.auth import ENGINE_API_KEY_ENV, ensure_engine_api_key
from relax.wire.core_share import CORES_META, new_token, remove_board
from relax.config.config import Config
from relax.config.env import role_runtime_env, threads_per_process, worker_env
from relax.config.support_gpu import flight_recorder_env
from relax.core.async_loop import AsyncLoop
from relax.core.calls import (BoundedCall, descendants, run_bounded, run_quietly, set_watch, start_bounded,
                              stop_processes, wait_all, wait_quietly)
from relax.core.deadlines import FLAGS, Call
from relax.formats.checkpoint_layout import iter_dir
from relax.core.checkpointing import resume_from, save_checkpoint, wait_for_pending_save
from relax.core.colocate import ColocateProtocol
from relax.core.health import MEGATRON_ROLES, HealthManager
from relax.core.health_restart import ATTEMPT_META, attempt_config
from relax.core.ray_cluster import start_ray
from relax.core.run_control import RunControl
from relax.roles.placement import (cluster_has_gpus, colocated_bundles, create_placement_group, role_bundles,
                                  trainer_gpus)
from relax.core.roles import AuxRoles, build_aux_roles, launch_aux_groups
from relax.core.run_context import RunContext
from relax.core.stages import Stages, run_group
from relax.core.step_tail import StepTimes, finish_step
from relax.data.plane import DataPlane
from relax.observability import timeline
from relax.observability.heartbeat import BOARD_META
from relax.observability.metrics import MetricsWriter
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
        if config.shares_idle_cores and CORES_META not in config.meta:  # the board the roles report their cores on
            config = Config(config.to_dict(), config.explicit, {**config.meta, CORES_META: new_token()},
                            config.derived)
        # the roles, data plane and bounded calls the loops use (relax.core.run_context); this object builds,
        # restarts and stops them
        self.ctx = RunContext(config, config.meta.get(ATTEMPT_META, 0))
        self.started = False  # start() completed
        self._shut = ""  # "" | "kept ray" (torn down for a restart) | "all"
        timeline.set_role("controller")  # this process's track in --timeline-dump-dir's trace
        self.started_ray = False
        # (actor, ref of its start) of the rollout engines begun before the rollout manager took them over; the
        # driver owns these actors, so the shutdown kills them too
        self._launched_engines: list[tuple[Any, Any]] | None = None
        # the data plane's start in a thread of its own (`start`), until it is the run's (`ctx.data`)
        self._data_start: BoundedCall | None = None
        self.placement_groups: list[Any] = []
        self.metrics_service = None  # the --use-metrics-service actor (relax.observability.metrics_service)
        # Processes this one had started before the run (e.g. a test's servers): the shutdown leaves them alone.
        # `earlier_children`: when Ray was started before this object (relax.core.run), those known before that.
        self._earlier_children = earlier_children if earlier_children is not None else {p.pid for p in descendants()}

    # the run's parts, as tests and the restart logic read them (each held once, by the run context)
    config = property(lambda self: self.ctx.config)
    attempt = property(lambda self: self.ctx.attempt)
    workers = property(lambda self: self.ctx.workers)
    aux = property(lambda self: self.ctx.aux)
    data = property(lambda self: self.ctx.data)
    rollout = property(lambda self: self.ctx.rollout)
    health = property(lambda self: self.ctx.health)
    run_control = property(lambda self: self.ctx.run_control)
    start_step = property(lambda self: self.ctx.start_step)

    @property
    def engine_urls(self) -> list[str]:
        """The engine pool's engines of the moment."""
        return self.ctx.engine_urls()

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        run, c = self.ctx, self.ctx.config
        # One secret per run guards every engine's control endpoints; roles receive it in their environment.
        engine_key = {ENGINE_API_KEY_ENV: ensure_engine_api_key()}
        if start_ray(c):
            self.started_ray = True
        if c.use_health_check:  # before the roles: every Megatron rank beats from its constructor on
            run.health = HealthManager(c)
            set_watch(run.health.watch)
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
        # or SGLang for seconds), then TransferQueue starts in a thread while they import and the trainer ranks
        # build their models, and only then does the controller wait for each role in turn. Nothing reads the
        # data plane before the trainer ranks attach to it (`_setup_trainers`) and the auxiliary roles' setup.
        self._pg_actor, self._use_gpu, self._engine_key = pg_actor, use_gpu, engine_key
        created = time.time()
        run.workers = self._create_trainers()
        # The rollout side (manager, engines, router) is independent of the trainer until the first weight push.
        # Colocated roles share devices, so on GPUs there the engines start after the trainer has taken its
        # memory; on CPU there is no device memory to share, and they start beside the trainer as otherwise.
        engines_early = not c.debug_train_only and (not c.colocate or not use_gpu)
        if engines_early and not c.rollout_external:
            # begun here, not by the rollout manager: see relax.roles.engine.launch_rollout_engines
            self._launched_engines = launch_rollout_engines(c, pg_rollout)
        launched_aux = launch_aux_groups(c, use_gpu=use_gpu)
        # held from now on, so that a failing start-up shuts them down too
        run.aux = AuxRoles(c, launched_aux.get("reference"), critic=launched_aux.get("critic"),
                           teacher=launched_aux.get("teacher"))
        run.rollout = RolloutManager.options(num_cpus=1,
                                             runtime_env=role_runtime_env({**worker_env(), **engine_key})).remote(c)
        engines_ref = None
        if engines_early:
            engines_ref = run.rollout.start_engines.remote(pg_rollout, weight_source=run.weight_source(),
                                                           launched=self._launched_engines)
        timeline.record("create the roles' actors", created, time.time(), cat="startup")
        # TransferQueue's controller and storage units start (one process after the other) while the trainer ranks
        # build their models; the ranks attach once both are done.
        self._data_start = start_bounded(self._start_data_plane, Call("data plane", "start"), deadline_s=None, flag="")
        with timeline.span("set up the trainer ranks", cat="startup"):
            self._setup_trainers()
        if run.health is not None:  # actors without heartbeats of their own: probed instead
            run.health.watch_actors({**run.data.actors(), **({"metrics service": self.metrics_service}
                                                               if self.metrics_service is not None else {})})
        with timeline.span("set up the auxiliary roles", cat="startup"):
            run.aux = build_aux_roles(c, use_gpu=use_gpu, data_plane=run.data, launched=launched_aux)
        run.stages = Stages(c, run.aux, trainers=run.trainers, trainer0=run.trainer0, bounded=run.bounded)
        engine_urls: list[str] = []
        if not c.debug_train_only:  # train-only debugging replays saved rollouts: no engines
            if engines_ref is None:
                engines_ref = run.rollout.start_engines.remote(pg_rollout,
                                                               weight_source=run.weight_source())
            with timeline.span("wait for the engines and router", cat="startup"):
                engine_urls = run.wait([run.rollout], [engines_ref], [Call("rollout", "engine and router start")],
                                       None, "")[0]
            logger.info("rollout: %d engine(s) behind %s", len(engine_urls),
                        run.rollout_call("router_url", "router address", None))
        run.metrics = MetricsWriter.from_config(c)
        if c.load or c.pretrained_checkpoint:  # bounded like a save: a rank stuck reading it ends the run by name
            source = c.load or c.pretrained_checkpoint
            self._resume(c.load, source, engine_urls)
        run.colocate = ColocateProtocol(c, run.workers, run.rollout)
        self.started = True

    def _create_trainers(self) -> list[Any]:
        """The trainer ranks' actors, one per bundle of the actor placement group (created, not yet set up)."""
        c = self.ctx.config
        actor_world = c.actor_world_size
        train_env = role_runtime_env({**flight_recorder_env(c), **worker_env(c.train_env_vars, training_role=True),
                                      **self._engine_key})
        return [
            TrainerWorker.options(num_cpus=1, num_gpus=trainer_gpus(c, self._use_gpu), runtime_env=train_env,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(
                                      placement_group=self._pg_actor, placement_group_bundle_index=rank)
                                  ).remote(c, rank, actor_world, threads_per_process(actor_world))
            for rank in range(actor_world)
        ]

    def _start_data_plane(self) -> DataPlane:
        c = self.ctx.config
        started = time.time()
        # "packed" moves each sample as one record: 3-5x faster than one message part per field.
        data = DataPlane.start(c.num_data_storage_units, capacity_samples=c.data_queue_samples,
                               polling_mode=c.polling_mode, layout="packed")
        timeline.record("start the data plane", started, time.time(), cat="startup")
        return data

    def _setup_trainers(self) -> None:
        """Wait for the trainer ranks' processes, build their models (one torch.distributed group) and attach them
        to the data plane, once it has started."""
        run, c = self.ctx, self.ctx.config
        master_addr, master_port = wait_all([run.workers[0].master_address.remote()],
                                            [Call("trainer", "start", rank=0)],  # the actor's creation, too
                                            deadline_s=run.deadlines.train_s, flag=FLAGS["train"])[0]
        backend = c.distributed_backend if self._use_gpu else "gloo"
        with timeline.span("build the trainer ranks' models", cat="startup"):
            infos = run.trainers("setup", "setup", None, master_addr, master_port, backend)
        if run.data is None:
            with timeline.span("wait for the data plane", cat="startup"):
                run.data = self._data_start.wait()
        run.trainers("attach_data_plane", "attach to the data plane", None)
        run.worker_where = [info.get("where") for info in infos]
        logger.info("trainer: %d rank(s), data-parallel %d, %d parameters", c.actor_world_size, infos[0]["dp"],
                    infos[0]["params"])

    def _resume(self, load: str | None, source: str | None, engine_urls: list[str]) -> None:
        """Restore the run from `load` (relax.core.checkpointing.resume_from), bounded like a save: a rank stuck
        reading it ends the run by name."""
        run = self.ctx
        run.start_step = run_bounded(lambda: resume_from(run.config, run.workers, run.aux, run.rollout, engine_urls,
                                                         load),
                                     Call("checkpoint", f"resume from {source}"), deadline_s=run.deadlines.train_s,
                                     flag=FLAGS["train"])

    def restart_megatron_roles(self, config: Config, load: str, failed_step: int | None) -> None:
        """--use-health-check, after a trainer, reference, teacher or critic rank failed in a synchronous run:
        replace those roles alone and resume them from `load`'s newest checkpoint, keeping Ray, the rollout
        manager with its engines and router, and the data plane (relax.core.health_restart chooses this before a
        restart of everything). `config`: the next attempt's (resuming from `load`, same heartbeat board).

        The checkpoint restores the trainer, the saved auxiliary roles and the rollout position, and its weights
        go to the engines (relax.core.checkpointing.resume_from); the failed step's partition is cleared, so every
        sample id reaches training once."""
        run = self.ctx
        set_watch(None)  # the failed ranks' old heartbeats must not end the restart's own waits
        if run.health is not None:
            run.health.kill_silent_ranks()  # a SIGSTOPped rank cannot act on Ray's kill
        aux_actors, aux_groups = self._aux_handles()
        for actor in run.workers + aux_actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        for pg in aux_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        if run.health is not None:
            run.health.forget(MEGATRON_ROLES)
            set_watch(run.health.watch)
        run.config, run.attempt = config, config.meta.get(ATTEMPT_META, run.attempt + 1)
        run.run_control = RunControl(config, run.attempt)
        if failed_step is not None:  # the one partition still stored: every earlier step's clear was waited for
            run.data_call("clear the failed step", failed_step, run.data.clear)
        run.workers = self._create_trainers()
        launched_aux = launch_aux_groups(config, use_gpu=self._use_gpu)
        run.aux = AuxRoles(config, launched_aux.get("reference"), critic=launched_aux.get("critic"),
                           teacher=launched_aux.get("teacher"))
        self._setup_trainers()
        run.aux = build_aux_roles(config, use_gpu=self._use_gpu, data_plane=run.data, launched=launched_aux)
        run.stages = Stages(config, run.aux, trainers=run.trainers, trainer0=run.trainer0, bounded=run.bounded)
        if run.metrics is not None:  # metrics.jsonl was rewritten without the steps done again: append to it
            run.metrics.close()
        run.metrics = MetricsWriter.from_config(config)
        # the engines a weight push must reach now (a replaced or added engine too; none that is draining)
        engine_urls = run.rollout_call("push_targets", "engines for the weight push", None)
        self._resume(load, load, engine_urls)
        # the pool's record of the engines' weights: the checkpoint's, as pushed
        run.rollout_call("weights_pushed", "weight version", None, run.start_step, engine_urls)
        # an engine that joins from now on (a replacement, the autoscaler's) takes its weights from the new rank 0:
        # the pool still holds the killed one's handle
        run.rollout_call("set_weight_source", "the engines' weight source", None, run.weight_source())
        run.colocate = ColocateProtocol(config, run.workers, run.rollout)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        run = self.ctx
        run.colocation("start", None, run.colocate.start)  # --offload-train: room for the first rollout
        if run.config.fully_async:  # the same stages, rollout ahead of training by --max-staleness steps
            AsyncLoop(run).run()
        else:
            with run.run_control.signal_handler():
                self._loop()
        # everything resident again for the final checks; after a failure the shutdown kills it all anyway
        run.colocation("finish", None, run.colocate.finish)

    def _loop(self) -> None:
        """The synchronous loop: each step's rollout, then its stages (relax.core.stages), then its tail
        (relax.core.step_tail)."""
        run, c = self.ctx, self.ctx.config
        run.evaluate_before_training()
        for step in range(run.start_step, c.num_rollout):
            run.current_step = step  # a restart of the Megatron roles clears the partitions up to it
            rollout_start = time.time()
            with timeline.span("rollout", step=step, cat="rollout"):
                metrics = run.rollout_call("generate", "generate", step, step)
            rollout_end = time.time()
            # what went through TransferQueue
            metrics["data/step_samples"] = float(run.data_call("count the step's samples", step, run.data.size))
            skipped = run.run_control.skips(step)  # --iterations-to-skip: rolled out, not trained
            if skipped:
                metrics["train/skipped_iteration"] = 1.0
                logger.info("step %d: skipped (--iterations-to-skip %d): rolled out, not trained", step, step + 1)
            if not c.debug_rollout_only:
                # engines release, trainer reloads
                metrics.update(run.colocation("release engines, reload trainer", step,
                                              lambda: run.colocate.before_train(step, run.pushes_after(step))))
                for group in run.stages.plan() if not skipped else ():
                    metrics.update(run_group(group, step))
            times = StepTimes(rollout_start, rollout_end, rollout_end, time.time())
            saved = finish_step(run, step, metrics, times, trained=not (c.debug_rollout_only or skipped),
                                rollout_state=lambda: ray.get(run.rollout.state_dict.remote()))
            if c.timeline_dump_dir and (step + 1 - run.start_step) % TIMELINE_MERGE_EVERY == 0:
                timeline.merge(c.timeline_dump_dir)  # a run stopped later still leaves the steps so far
            if step + 1 < c.num_rollout and self._stop_early(step, saved):
                break
        run.summarize()

    def _stop_early(self, step: int, saved: bool) -> bool:
        """--exit-duration-in-mins / --exit-signal-handler (relax.core.run_control): after step `step`, save (unless
        this step was saved) and say why the run stops here."""
        run, c = self.ctx, self.ctx.config
        reason = run.run_control.stop_reason()
        if reason is None:
            return False
        path = None
        if c.save:
            if saved:
                final = lambda: wait_for_pending_save(c.save)  # noqa: E731
            else:
                final = lambda: save_checkpoint(c, run.workers, run.aux,  # noqa: E731
                                                ray.get(run.rollout.state_dict.remote()), step + 1, True)
            run_bounded(final, Call("checkpoint", "save before stopping", step=step), deadline_s=run.deadlines.train_s,
                        flag=FLAGS["train"])
            path = iter_dir(c.save, step + 1)
        run.run_control.stopped = run.run_control.stop_line(reason, step + 1, c.num_rollout, path)
        logger.warning("%s", run.run_control.stopped)
        return True

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
        grace = self.ctx.deadlines.shutdown_s
        started = ([p for p in descendants() if p.pid not in self._earlier_children]
                   if self.started_ray and not keep_ray else [])
        if self.health is not None:  # a SIGSTOPped rank cannot act on Ray's kill: SIGKILL it first
            killed = self.health.kill_silent_ranks()
            if killed:
                trace_log.warning("shutdown: killed silent rank process(es) %s", killed)
        busy = self.ctx.busy_actors()
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
        elif self._data_start is not None:  # the start-up failed while the data plane started: stop what it started
            run_quietly(lambda: self._data_start.wait().shutdown(), grace, "stop the data plane")
        for pg in self.placement_groups + aux_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        if self.ctx.metrics is not None:
            self.ctx.metrics.close()
        if self.health is not None:
            self.health.close()
        if self.started_ray and not keep_ray and ray.is_initialized():
            ray.shutdown()
        left = stop_processes(started)
        if left:
            trace_log.warning("shutdown: signalled %d process(es) still running: %s", len(left), left)
        sweep_stale_segments()  # the trainer's /dev/shm segment, when its process was killed before closing it
        if not keep_ray and self.config.meta.get(CORES_META):  # this node's board of idle cores (a restart keeps it)
            remove_board(self.config.meta[CORES_META])
        if self.config.timeline_dump_dir:  # every span the roles wrote, also after a failure
            try:
                path = timeline.merge(self.config.timeline_dump_dir)
                logger.info("timeline: %s (load it in ui.perfetto.dev or chrome://tracing)", path)
            except OSError as exc:
                logger.warning("timeline: could not write %s: %s", self.config.timeline_dump_dir, exc)

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
