"""`relax-train`'s run around the controller: the run's folder and logs, the embedded default's assets and the
preflight checks (all before Ray), Ray's start, the controller's attempts (restarted from the last checkpoint
under --use-health-check), signals, and the exit code.

Start-up overlap: relax.core.controller imports torch, Megatron-core and TransferQueue (seconds of CPU on a small
machine; the driver uses them for the actor classes and the data plane). That import runs in a thread while
the main thread prepares the run and starts Ray, whose own processes take seconds to come up; so this module
imports the controller in `_ControllerImport`, not at its top."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import ray

from relax import heap
from relax.config.config import Config
from relax.config.env import TIMELINE_ENV
from relax.config.errors import ConfigError
from relax.config.explain import write_resolved_config
from relax.core.calls import descendants
from relax.core.deadlines import console_line
from relax.health_faults import fault_from_env
from relax.core.health_restart import Restarts
from relax.core.preflight import preflight
from relax.core.ray_cluster import start_ray
from relax.models.embedded import build_embedded_assets
from relax.observability import timeline

logger = logging.getLogger("relax")
trace_log = logging.getLogger("relax.trace")  # tracebacks: the run's log file only


def _raise_interrupt(signum, frame):
    _raise_interrupt.received = signal.Signals(signum).name  # Ray may re-raise the interrupt without its text
    raise KeyboardInterrupt(_raise_interrupt.received)


def _note_signal(signum, frame):
    """During the shutdown: a second SIGTERM/SIGINT must not cut the cleanup short (it is bounded anyway)."""
    logger.warning("%s received during shutdown; still stopping", signal.Signals(signum).name)


def _install_signal_handlers(handler=_raise_interrupt) -> None:
    """SIGTERM and SIGINT stop the run cleanly, also when the shell started it with SIGINT ignored
    (a background job of a script) or Ray replaced a handler."""
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


class _ControllerImport:
    """relax.core.controller, imported in a thread of its own from construction on; `module()` waits for it and
    raises what the import raised."""

    NAME = "relax.core.controller"

    def __init__(self) -> None:
        self._module: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._load, name="relax-import-controller", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        start = time.time()
        try:
            self._module = importlib.import_module(self.NAME)
        except BaseException as exc:  # handed to the main thread by module()
            self._error = exc
        # --timeline-dump-dir is known by the import's end (prepare_run)
        timeline.record("import the controller", start, time.time(), cat="startup")

    def module(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._module


def prepare_run(config: Config) -> int | None:
    """The run's folder, logging, resolved config, embedded assets and preflight checks; 2 when a check
    fails (logged), else None."""
    out = Path(config.output_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)  # logs and configs of a run can hold paths and hosts of a private setup: owner only
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=[logging.StreamHandler(), logging.FileHandler(out / "logs" / "relax.log")])
    write_resolved_config(config)
    if config.timeline_dump_dir:  # before Ray: every role inherits it (relax.config.env.worker_env)
        os.environ[TIMELINE_ENV] = str(Path(config.timeline_dump_dir).resolve())
    if config.dump_details:
        write_resolved_config(config, Path(config.dump_details) / "config.yaml")
    if config.meta.get("embedded_default"):
        info = build_embedded_assets(config.hf_checkpoint, config.prompt_data, seed=config.seed % 1000)
        logging.getLogger("relax.details").info("embedded default assets: %s", info)  # the log file only
    try:
        for note in preflight(config):
            logger.warning("%s", note)
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    trace_log.propagate = False  # full tracebacks go to the log file only
    trace_log.addHandler(logging.FileHandler(out / "logs" / "relax.log"))
    return None


def run_controller(config: Config) -> int:
    """The whole run; its exit code (0, 1 failed, 2 a preflight error, 128 + N for signal N)."""
    # from the first moment: the import overlaps the run's preparation and Ray's start
    controller_import = _ControllerImport()
    code = prepare_run(config)
    if code is not None:
        return code
    out = Path(config.output_dir)
    log_path = out / "logs" / "relax.log"
    # The failure the loop reports is the one line below; errors of the other ranks' calls that were left
    # behind would otherwise print their tracebacks on the console when Ray drops them.
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    _install_signal_handlers()
    earlier_children = {p.pid for p in descendants()}  # e.g. a test's servers: the shutdown leaves them alone
    controller = None
    started_ray = False
    timeline.set_role("controller")  # this process's track in --timeline-dump-dir's trace, from its start-up on
    try:
        with timeline.span("start Ray", cat="startup"):
            started_ray = start_ray(config)
        _install_signal_handlers()  # ray.init replaces the SIGTERM handler with its own sys.exit
        with timeline.span("wait for the controller's import", cat="startup"):
            Controller = controller_import.module().Controller
        controller = Controller(config, earlier_children=earlier_children)
        controller.started_ray = started_ray
        controller.ctx.fault = fault_from_env()  # tests only: RELAX_TEST_TRAINER_FAULT (relax.health_faults)
        restarts = Restarts(config) if config.use_health_check else None
        while True:
            try:
                if not controller.started:  # a restart of the Megatron roles alone keeps the rest started
                    controller.start()
                    heap.freeze()  # the controller's roles and handles live as long as the run (relax.heap)
                if restarts is not None:
                    restarts.started(controller)
                controller.run()
                break
            except Exception as exc:  # --use-health-check: tear the attempt down, resume from the checkpoint
                if restarts is None or not restarts.should_restart(controller, exc):
                    raise
                trace_log.error("traceback of the failure before restart %d", restarts.ledger.restarts + 1,
                                exc_info=True)
                controller = restarts.restart(controller, Controller, exc)
        if controller.run_control.stopped:  # --exit-duration-in-mins / --exit-signal-handler: a clean stop
            logger.info("stopped early (%s); output in %s", controller.run_control.stopped, out)
        else:
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
        logger.error("%s", console_line(exc, log_path))
        trace_log.error("traceback of the failure", exc_info=True)
        return 1
    finally:
        _install_signal_handlers(_note_signal)
        if controller is not None:
            controller.shutdown()
        elif started_ray and ray.is_initialized():  # interrupted before the controller existed
            ray.shutdown()
