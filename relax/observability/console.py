"""The console of `relax-train`: Relax's own lines there, everything else in the run's log file, each once.

On the console (relax-train's stdout and stderr):
  * the driver's `relax` log records, the `[relax] step N: ...` line of each step, `relax-train: warning|error:`;
  * the rollout progress bar, which the rollout manager draws and Ray forwards (shown without Ray's prefix;
    redrawn in place on a terminal);
  * WARNING and worse records of the `relax` loggers inside the roles (Ray workers): `setup_worker`, Ray's
    worker set-up hook, gives them the driver's line shape, so they are told apart from library output.
In `<output-dir>/logs/relax.log` only:
  * records of the `relax.details` logger (`DETAILS`): whole dicts and other detail behind a console line, which
    keeps one line per fact;
  * the driver's Python warnings: Megatron and Transformer Engine warn while they are imported, before the log
    file exists, so `hold_warnings` keeps them from the start of relax-train until `route` writes them;
  * records of every other logger of the driver (Ray's start-up notices, TransferQueue's client);
  * whatever else the workers print (Python warnings, TransferQueue's, Megatron's and Ray's notices, prints),
    each distinct line once: numbers are ignored when comparing, so a warning that TransferQueue repeats on
    every call, or every rank prints, is written the first time with the worker it came from, and counted
    (`WorkerOutput`). A batch holding a traceback is written whole.

Errors stay one console line: the controller's `run failed: ... (traceback in .../relax.log)`.

This module imports no Ray: relax-train imports it before parsing (for `hold_warnings`), and workers run
`setup_worker` before anything else. `relax.observability.ray_console` hands Ray's forwarded output to
`WorkerOutput`.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, TextIO

# The line shape of Relax's records, the driver's (relax.core.controller) and the workers' (setup_worker).
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
RELAX_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} relax(\.[\w.-]+)? (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
# The rollout manager's tqdm bar (relax.roles.rollout: desc "rollout N").
PROGRESS = re.compile(r"^rollout \d+: ")
# Words holding a digit (timestamps, pids, counts, addresses) do not make two lines different.
_NUMBERED = re.compile(r"\S*\d\S*")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# Relax's records for the log file only (see the module docstring): `logging.getLogger(DETAILS)`.
DETAILS = "relax.details"

_bar = {"open": False, "stream": None}
_bar_lock = threading.Lock()


def is_relax_logger(name: str) -> bool:
    return name == "relax" or name.startswith("relax.")


def is_details_logger(name: str) -> bool:
    return name == DETAILS or name.startswith(DETAILS + ".")


class RelaxOnly(logging.Filter):
    """The console handler's filter: records of Relax's loggers pass, any other logger's (and `DETAILS`) go to the
    file only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return is_relax_logger(record.name) and not is_details_logger(record.name)


class ConsoleHandler(logging.StreamHandler):
    """A stream handler that first clears a progress bar drawn in place on the same terminal."""

    def emit(self, record: logging.LogRecord) -> None:
        clear_progress()
        super().emit(record)


def clear_progress() -> None:
    """Erase the progress bar if it is drawn in place on a terminal, so that the next line starts clean."""
    with _bar_lock:
        if _bar["open"]:
            _bar["stream"].write("\r\x1b[K")
            _bar["stream"].flush()
            _bar["open"] = False


def canonical(line: str) -> str:
    """`line` as compared for repeats: words holding digits and spacing left out."""
    return " ".join(_NUMBERED.sub(" ", line).split())


class HeldWarnings:
    """Python warnings of this process, kept (not shown) from `hold_warnings` until `replay` or `restore`."""

    def __init__(self) -> None:
        self.held: list[tuple] = []
        self._original = warnings.showwarning

    def _hold(self, message, category, filename, lineno, file=None, line=None) -> None:
        if file is not None:  # written to a file the caller chose: not console output
            self._original(message, category, filename, lineno, file, line)
            return
        self.held.append((message, category, filename, lineno, None, line))

    def replay(self) -> None:
        """Show the held warnings through whatever `warnings.showwarning` is now (the log file's, in `route`)."""
        held, self.held = self.held, []
        for args in held:
            warnings.showwarning(*args)

    def restore(self) -> None:
        warnings.showwarning = self._original


def hold_warnings() -> HeldWarnings:
    """From now on, this process's Python warnings wait for `route` (which writes them to the log file)."""
    held = HeldWarnings()
    warnings.showwarning = held._hold
    return held


@contextmanager
def route(log_path: Path, held: HeldWarnings | None = None) -> Iterator["WorkerOutput"]:
    """Within: the driver logs as the module docstring says (root logger: console for Relax's records, the log
    file for all), Python warnings go to the file (the held ones first), and the returned `WorkerOutput` takes
    the workers' output once `relax.observability.ray_console.route_ray_output` connects it. Everything is
    put back on exit (relax-train's `main` is also called inside test processes)."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    console = ConsoleHandler()
    console.addFilter(RelaxOnly())
    file = logging.FileHandler(log_path)
    for handler in (console, file):
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # "py.warnings" records: the file only (RelaxOnly)
    if held is not None:
        held.replay()
    output = WorkerOutput(file)
    try:
        yield output
    finally:
        output.close()
        logging.captureWarnings(False)
        if held is not None:
            held.restore()
        root.removeHandler(console)
        root.removeHandler(file)
        root.setLevel(level)
        file.close()


class WorkerOutput:
    """Sorts the lines Ray forwards from the workers: Relax's records and the progress bar to the console,
    the rest to the log file once (see the module docstring). Called by Ray's log thread with one batch at a
    time: a dict with `lines`, `pid`, `ip`, `actor_name` / `task_name`, `is_err` and `localhost`."""

    def __init__(self, file: logging.Handler, console: TextIO | None = None) -> None:
        self.file = file
        self.console = console  # None: sys.stderr at the time of writing (pytest's capture replaces it)
        # Ray's monitor forwards its whole status report every few seconds; Ray's driver keeps only the event
        # lines of it (ray_console sets Ray's own filter here). None: none of it.
        self.autoscaler_events: Any = None
        self.lines = 0
        self.written = 0
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def _console(self) -> TextIO:
        return self.console if self.console is not None else sys.stderr

    def _write_file(self, text: str) -> None:
        record = logging.LogRecord("workers", logging.INFO, __file__, 0, text, None, None)
        self.file.handle(record)

    def __call__(self, data: dict[str, Any], ignore_prefix: bool = False) -> None:
        lines = [_ANSI.sub("", line) for line in data.get("lines") or []]
        if data.get("pid") == "autoscaler":
            lines = list(self.autoscaler_events(lines)) if self.autoscaler_events is not None else []
        source = _source(data)
        with self._lock:
            if any("Traceback (most recent call last)" in line for line in lines):
                self.lines += len(lines)
                self.written += len(lines)
                self._write_file(f"({source}) " + "\n".join(lines))
                return
            for line in lines:
                self._line(source, line)

    def _line(self, source: str, line: str) -> None:
        parts = [part.strip() for part in line.split("\r")]  # tqdm redraws with carriage returns
        if any(PROGRESS.match(part) for part in parts):
            last = [part for part in parts if part][-1:]
            if last and PROGRESS.match(last[0]):
                self._progress(last[0])
            else:
                clear_progress()
            return
        if not line.strip():
            if _bar["open"]:  # tqdm's closing line (leave=False) clears the bar
                clear_progress()
            return
        if RELAX_RECORD.match(line):
            clear_progress()
            self._console().write(line.rstrip() + "\n")
            self._console().flush()
            self._write_file(f"({source}) {line.rstrip()}")
            return
        self.lines += 1
        key = canonical(line)
        if key in self._seen:
            return
        self._seen.add(key)
        self.written += 1
        self._write_file(f"({source}) {line.rstrip()}")

    def _progress(self, text: str) -> None:
        stream = self._console()
        with _bar_lock:
            if stream.isatty():
                stream.write("\r" + text + "\x1b[K")
                _bar.update(open=True, stream=stream)
            else:
                stream.write(text + "\n")
            stream.flush()

    def close(self) -> None:
        clear_progress()
        if self.lines:
            self._write_file(f"workers printed {self.lines} line(s) that are not Relax's; {self.written} distinct "
                             "one(s) are written above, repeats left out")


def _source(data: dict[str, Any]) -> str:
    name = data.get("actor_name") or data.get("task_name") or ""
    pid = data.get("pid")
    where = f"{name} pid={pid}".strip() if pid not in ("raylet", "autoscaler") else str(pid)
    ip = data.get("ip")
    if ip and ip != data.get("localhost"):
        where += f", ip={ip}"
    return where


def setup_worker() -> None:
    """Part of Ray's worker set-up hook (relax.core.worker_setup), run in every worker of the run before its actor's module
    is imported: Relax's records of WARNING and worse go to stderr in the driver's line shape, which the driver
    shows on the console. Without it, Python's last-resort handler prints them bare, like library output."""
    log = logging.getLogger("relax")
    if any(getattr(h, "_relax_worker", False) for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.setLevel(logging.WARNING)
    handler._relax_worker = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.propagate = False  # one line per record, whatever a library does to the root logger
