"""`--use-clearml`: a ClearML task per run, fed by `MetricsWriter` like TensorBoard.

What goes to the task: every scalar of each metrics.jsonl record (list-valued metrics summarised, see
`relax.observability.metrics.scalars`), the resolved config (secrets redacted, `relax.config.redact`) as the
hyperparameter section "relax", and at the end the artifacts `resolved_config` (the run's
resolved_config.yaml) and `final_metrics` (the last record). The task lives in project `--tb-project-name`
(default "relax") and is named `--tb-experiment-name` (default: the output folder's name).

Where it goes: the ClearML server of the machine's configuration (`clearml-init` writes ~/clearml.conf; or
$CLEARML_CONFIG_FILE, or $CLEARML_API_HOST with $CLEARML_API_ACCESS_KEY/$CLEARML_API_SECRET_KEY). With
CLEARML_OFFLINE_MODE=1 (ClearML's own switch) nothing is sent: ClearML writes the session to a folder and a zip
under its cache ($CLEARML_CACHE_DIR/offline, default ~/.clearml/cache/offline), which
`Task.import_offline_session(zip)` uploads later. Without either, `require_clearml_target` stops the run before
Ray starts: ClearML would otherwise fail inside the controller after the cluster is up.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any, Mapping

from clearml import Task
from clearml.backend_api.session.defs import ENV_ACCESS_KEY, ENV_HOST, ENV_OFFLINE_MODE
from clearml.backend_config.defs import get_active_config_file

from relax.config.errors import ConfigError
from relax.config.explain import resolved_values

logger = logging.getLogger("relax.clearml")
DEFAULT_PROJECT = "relax"
HYPERPARAMS_SECTION = "relax"


def offline_requested() -> bool:
    """CLEARML_OFFLINE_MODE is set to a true value (ClearML's converter: 1/true/yes/on)."""
    return bool(ENV_OFFLINE_MODE.get())


def clearml_target_problem() -> str | None:
    """Why --use-clearml has nowhere to report to, or None when a server is configured or offline mode is on."""
    if offline_requested():
        return None
    if get_active_config_file() or ENV_HOST.get() or ENV_ACCESS_KEY.get():
        return None
    return ("--use-clearml: ClearML is not configured on this machine (no ~/clearml.conf, $CLEARML_CONFIG_FILE or "
            "$CLEARML_API_HOST). Run `clearml-init` to connect it to a ClearML server, or set CLEARML_OFFLINE_MODE=1 "
            "to record the run offline (ClearML writes a session zip under ~/.clearml/cache/offline that "
            "`Task.import_offline_session(zip)` uploads later)")


def require_clearml_target(config: Any) -> None:
    """Raises ConfigError (before Ray starts) when --use-clearml is set without a server or offline mode."""
    if config.use_clearml:
        problem = clearml_target_problem()
        if problem:
            raise ConfigError(problem)


def task_names(config: Any) -> tuple[str, str]:
    """(project, task name) of the run's ClearML task."""
    project = config.tb_project_name or DEFAULT_PROJECT
    name = config.tb_experiment_name or Path(config.output_dir).resolve().name or "run"
    return project, name


class ClearMLSink:
    """One ClearML task: scalars per step, hyperparameters at start, artifacts at close."""

    def __init__(self, project: str, task_name: str, hyperparams: Mapping[str, Any] | None = None):
        if offline_requested():
            # ClearML reads CLEARML_OFFLINE_MODE once, when it is first imported; the run may set it later.
            Task.set_offline(True)
        # In-process reporting: ClearML otherwise forks a reporter process from the driver (which holds Ray's
        # threads), and closing the task waits ~10 s for it to notice.
        if hasattr(Task, "_report_subprocess_enabled"):
            Task._report_subprocess_enabled = False
        saved = _signal_handlers()
        # No framework, argparse or resource hooks: the command line would carry --notify-urls unredacted,
        # and Relax reports its metrics itself.
        self.task = Task.init(project_name=project, task_name=task_name, reuse_last_task_id=False,
                              auto_connect_arg_parser=False, auto_connect_frameworks=False,
                              auto_resource_monitoring=False)
        _restore_signal_handlers(saved)  # the controller's SIGTERM/SIGINT handling stays in charge
        self._logger = self.task.get_logger()
        if hyperparams:
            self.task.connect(dict(hyperparams), name=HYPERPARAMS_SECTION)
        where = f"offline, session in {self.task.get_offline_mode_folder()}" if Task.is_offline() else "online"
        logger.info("ClearML task %r in project %r (%s)", task_name, project, where)

    @classmethod
    def from_config(cls, config: Any) -> "ClearMLSink":
        project, name = task_names(config)
        return cls(project, name, resolved_values(config))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            title, _, series = key.partition("/")
            self._logger.report_scalar(title, series or title, value=value, iteration=step)

    def close(self, *, resolved_config: str | Path | None = None, final_metrics: Mapping[str, Any] | None = None
              ) -> Path | None:
        """Uploads the artifacts and closes the task; returns the offline session zip (None when online)."""
        try:
            if resolved_config is not None and Path(resolved_config).is_file():
                self.task.upload_artifact("resolved_config", artifact_object=str(resolved_config),
                                          wait_on_upload=True)
            if final_metrics:
                self.task.upload_artifact("final_metrics", artifact_object=dict(final_metrics), wait_on_upload=True)
        finally:
            offline = Task.is_offline()
            folder = Path(self.task.get_offline_mode_folder()) if offline else None
            saved = _signal_handlers()
            self.task.close()
            _restore_signal_handlers(saved)
        if folder is None:
            return None
        zipped = folder.with_suffix(".zip")
        logger.info("ClearML offline session: %s", zipped if zipped.exists() else folder)
        return zipped if zipped.exists() else folder


def _signal_handlers() -> dict:
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore_signal_handlers(saved: dict) -> None:
    """ClearML hooks SIGINT/SIGTERM at init and puts back what it found at close; the controller changes its
    handlers in between (shutdown), so the ones current before each call are put back."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)

