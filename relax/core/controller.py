"""The controller: builds the roles as Ray actors and runs the synchronous RL loop.

One step: rollout (engines behind the router) -> samples into the step's TransferQueue partition ->
trainer group reads them, computes advantages and updates -> partition cleared -> weights pushed to
every engine (versioned, verified) -> metrics -> checkpoint every --save-interval.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import ray

from relax.backends.auth import ENGINE_API_KEY_ENV, ensure_engine_api_key
from relax.config.config import Config
from relax.config.errors import ConfigError
from relax.core.preflight import preflight

logger = logging.getLogger("relax")


class Controller:
    def __init__(self, config: Config):
        self.config = config
        self.started_ray = False
        self.data = None
        self.workers: list[Any] = []
        self.rollout = None
        self.placement_groups: list[Any] = []
        self.metrics = None
        self.engine_urls: list[str] = []
        self.start_step = 0
        self.aux = None
        self.colocate = None

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        from relax.config.env import worker_env
        from relax.core.placement import cluster_has_gpus, create_placement_group, role_bundles
        from relax.data.plane import DataPlane
        from relax.observability.metrics import MetricsWriter
        from relax.roles.rollout import RolloutManager
        from relax.roles.trainer import TrainerWorker

        c = self.config
        actor_world = c.actor_world_size
        # One secret per run guards every engine's control endpoints; roles receive it in their environment.
        engine_key = {ENGINE_API_KEY_ENV: ensure_engine_api_key()}
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            env = {**worker_env(), **engine_key}
            if address:
                ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
            else:
                ray.init(num_cpus=max(16, 4 * actor_world + 8), include_dashboard=False,
                         runtime_env={"env_vars": env}, log_to_driver=True)
            self.started_ray = True
        use_gpu = cluster_has_gpus()
        capacity = c.rollout_batch_size * (c.max_staleness + 1) * c.n_samples_per_prompt
        # "packed" moves each sample as one record: 3-5x faster than one message part per field.
        self.data = DataPlane.start(c.num_data_storage_units, capacity_samples=capacity,
                                    polling_mode=c.polling_mode, layout="packed")
        if c.colocate:  # engines and trainer ranks on the same bundles (devices), taking turns
            from relax.core.placement import colocated_bundles

            pg_actor = pg_rollout = create_placement_group(colocated_bundles(c, use_gpu), "relax-colocate")
        else:
            pg_actor = create_placement_group(role_bundles(c, "actor", use_gpu), "relax-actor")
            pg_rollout = create_placement_group(role_bundles(c, "rollout", use_gpu), "relax-rollout")
        self.placement_groups = list({id(pg): pg for pg in (pg_actor, pg_rollout) if pg is not None}.values())

        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        threads = max(1, (os.cpu_count() or 2) // max(1, actor_world))
        train_env = {"env_vars": {**worker_env(c.train_env_vars, training_role=True), **engine_key}}
        from relax.core.placement import trainer_gpus

        self.workers = [
            TrainerWorker.options(num_cpus=1, num_gpus=trainer_gpus(c, use_gpu), runtime_env=train_env,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(
                                      placement_group=pg_actor, placement_group_bundle_index=rank)
                                  ).remote(c, rank, actor_world, threads)
            for rank in range(actor_world)
        ]
        master_addr, master_port = ray.get(self.workers[0].master_address.remote())
        backend = c.distributed_backend if use_gpu else "gloo"
        infos = ray.get([w.setup.remote(master_addr, master_port, backend) for w in self.workers])
        logger.info("trainer: %d rank(s), data-parallel %d, %d parameters", actor_world, infos[0]["dp"],
                    infos[0]["params"])
        self.rollout = RolloutManager.options(num_cpus=1, runtime_env={"env_vars": engine_key}).remote(c)
        if not c.debug_train_only:  # train-only debugging replays saved rollouts: no engines
            self.engine_urls = ray.get(self.rollout.start_engines.remote(pg_rollout))
            logger.info("rollout: %d engine(s) behind %s", len(self.engine_urls),
                        ray.get(self.rollout.router_url.remote()))
        from relax.core.roles import build_aux_roles

        self.aux = build_aux_roles(c, use_gpu=use_gpu, data_plane=self.data)
        self.metrics = MetricsWriter.from_config(c)
        if c.load:
            self._resume(c.load)
        from relax.core.colocate import ColocateProtocol

        self.colocate = ColocateProtocol(c, self.workers, self.engine_urls)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        self.colocate.start()  # --offload-train: the trainer makes room for the first rollout
        try:
            self._loop()
        finally:
            self.colocate.finish()

    def _loop(self) -> None:
        c = self.config
        if self._eval_enabled() and not c.skip_eval_before_train:
            self.metrics.log(self.start_step, {**ray.get(self.rollout.evaluate.remote(self.start_step)),
                                               "eval/before_train": 1.0})
        for step in range(self.start_step, c.num_rollout):
            t0 = time.perf_counter()
            metrics = ray.get(self.rollout.generate.remote(step))
            t1 = time.perf_counter()
            metrics["data/step_samples"] = float(self.data.size(step))  # what went through TransferQueue
            will_sync = (step + 1) % c.update_weights_interval == 0 and not (c.debug_rollout_only
                                                                            or c.debug_train_only)
            if not c.debug_rollout_only:
                metrics.update(self.colocate.before_train(step, will_sync))  # engines release, trainer reloads
                extras = self.aux.pre_train(step)
                outputs = ray.get([w.train.remote(step, extras) for w in self.workers])
                self.aux.post_train(step, outputs[0])
                metrics.update(outputs[0])
            t2 = time.perf_counter()
            self.data.clear(step)
            sync_time = 0.0
            if will_sync:
                metrics.update(self.colocate.before_sync(step))  # engines' weights back, KV cache still released
                reports = ray.get([w.push_weights.remote(self.engine_urls, step + 1, c.update_weight_buffer_size)
                                   for w in self.workers])
                sync = reports[0]
                sync_time = time.perf_counter() - t2
                self.aux.after_weight_update(step)
                metrics.update({"perf/weight_sync_bytes": float(sync["bytes"]),
                                "perf/weight_sync_bytes_per_s": sync["bytes_per_s"],
                                "weights/version": float(step + 1)})
            t3 = time.perf_counter()
            if c.save and ((c.save_interval and (step + 1) % c.save_interval == 0) or step + 1 == c.num_rollout):
                self.save(step + 1)
            step_time = time.perf_counter() - t0
            metrics.update({
                "perf/rollout_time": t1 - t0, "perf/train_time": t2 - t1, "perf/weight_sync_time": sync_time,
                "perf/save_time": time.perf_counter() - t3, "perf/step_time": step_time,
                "perf/tokens_per_s": metrics.get("train/tokens", 0.0) / step_time,
                "perf/samples_per_s": metrics.get("rollout/num_samples", 0.0) / step_time,
            })
            metrics.update(self.colocate.after_step(step))  # trainer offloads, engines resume the KV cache
            if self._eval_enabled() and (step + 1) % c.eval_interval == 0:
                metrics.update(ray.get(self.rollout.evaluate.remote(step + 1)))
            self.metrics.log(step, metrics)

    def _eval_enabled(self) -> bool:
        c = self.config
        return bool(c.eval_interval) and bool(c.eval_prompt_data or c.eval_config)

    # ------------------------------------------------------------------ checkpoints
    def save(self, rollout_id: int) -> Path:
        from relax.core.checkpointing import save_checkpoint

        return save_checkpoint(self, rollout_id)

    def _resume(self, load: str) -> None:
        from relax.core.checkpointing import resume_from

        resume_from(self, load)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        if self.aux is not None:
            try:
                self.aux.shutdown()
            except Exception as exc:
                logger.warning("auxiliary roles shutdown: %s", exc)
        if self.rollout is not None:
            try:
                ray.get(self.rollout.shutdown.remote(), timeout=60)
            except Exception as exc:
                logger.warning("rollout shutdown: %s", exc)
        for w in self.workers:
            try:
                ray.get(w.shutdown.remote(), timeout=30)
            except Exception:
                pass
        for actor in self.workers + ([self.rollout] if self.rollout is not None else []):
            try:
                ray.kill(actor)
            except Exception:
                pass
        if self.data is not None:
            try:
                self.data.shutdown()
            except Exception as exc:
                logger.warning("data plane shutdown: %s", exc)
        from ray.util.placement_group import remove_placement_group

        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        if self.metrics is not None:
            self.metrics.close()
        if self.started_ray and ray.is_initialized():
            ray.shutdown()


def _raise_interrupt(signum, frame):
    _raise_interrupt.received = signal.Signals(signum).name  # Ray may re-raise the interrupt without its text
    raise KeyboardInterrupt(_raise_interrupt.received)


def _install_signal_handlers() -> None:
    """SIGTERM and SIGINT stop the run cleanly, also when the shell started it with SIGINT ignored
    (a background job of a script) or Ray replaced a handler."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)


def run_controller(config: Config) -> int:
    from relax.config.explain import write_resolved_config

    out = Path(config.output_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)  # logs and configs of a run can hold paths and hosts of a private setup: owner only
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=[logging.StreamHandler(), logging.FileHandler(out / "logs" / "relax.log")])
    write_resolved_config(config)
    if config.dump_details:
        write_resolved_config(config, Path(config.dump_details) / "config.yaml")
    if config.meta.get("embedded_default"):
        from relax.models.embedded import build_embedded_assets

        info = build_embedded_assets(config.hf_checkpoint, config.prompt_data, seed=config.seed % 1000)
        logger.info("embedded default assets: %s", info)
    try:
        for note in preflight(config):
            logger.warning("%s", note)
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    trace_log = logging.getLogger("relax.trace")  # full tracebacks go to the log file only
    trace_log.propagate = False
    trace_log.addHandler(logging.FileHandler(out / "logs" / "relax.log"))
    _install_signal_handlers()
    controller = Controller(config)
    try:
        controller.start()
        _install_signal_handlers()  # ray.init replaces the SIGTERM handler with its own sys.exit
        controller.run()
        logger.info("finished %d rollout steps; output in %s", config.num_rollout, out)
        return 0
    except KeyboardInterrupt:
        received = getattr(_raise_interrupt, "received", None) or "SIGINT"
        logger.error("interrupted by %s; shutting down", received)
        return 128 + signal.Signals[received].value  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
    except SystemExit as exc:  # a signal that arrived while Ray's own handler was installed
        logger.error("terminated (exit %s); shutting down", exc.code)
        return 143
    except Exception as exc:
        logger.error("run failed: %s: %s (traceback in %s)", type(exc).__name__, _first_line(exc),
                     out / "logs" / "relax.log")
        trace_log.error("traceback of the failure", exc_info=True)
        return 1
    finally:
        controller.shutdown()


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        text = f"{type(cause).__name__}: {cause}"
    return text.strip().splitlines()[-1] if text.strip() else repr(exc)
