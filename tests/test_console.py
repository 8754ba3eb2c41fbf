"""The console of relax-train holds Relax's own lines only; library output goes to the run's log file, once
(relax/observability/console.py, ray_console.py). Unit tests here; the whole runs that check their real
console with `foreign_lines` are tests/test_run_deadlines.py (the embedded default, failing on purpose:
errors stay one line) and tests/test_ray_job_submit.py (the embedded default, one step through `ray job
submit`)."""

from __future__ import annotations

import io
import logging
import re
import warnings

import pytest
import ray._private.worker as ray_worker

from relax.observability import console
from relax.observability.ray_console import route_ray_output

# What Relax itself prints, and nothing else (a strict allow-list): its log records (the driver's, and the
# roles' warnings in the same shape), the step line, relax-train's own warning/error lines, the progress bar.
RELAX_LINE_SHAPES = [
    re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} relax(\.[\w.-]+)? (INFO|WARNING|ERROR|CRITICAL) \S"),
    re.compile(r"^\[relax\] step \d+: "),
    re.compile(r"^relax-train: (warning|error): "),
    re.compile(r"^rollout \d+: +\d+%\|"),
]
# Library output a run of the embedded default prints, which belongs in the log file.
MEGATRON_WARNING = "Transformer Engine and Apex are not installed"


def foreign_lines(text: str) -> list[str]:
    """The lines of a console that are not Relax's own (blank lines aside)."""
    return [line for line in text.splitlines() if line.strip() and not any(s.match(line) for s in RELAX_LINE_SHAPES)]


def assert_console_clean(text: str, log_text: str) -> None:
    """A run's console holds Relax's lines only; the log file holds the library output, each line once."""
    foreign = foreign_lines(text)
    assert not foreign, f"{len(foreign)} console line(s) not Relax's, e.g. {foreign[:5]}"
    assert MEGATRON_WARNING in log_text, log_text[-2000:]
    # once: the driver's own (a Python warning record) and the first worker's (numbers aside, the others repeat it)
    lines = [line for line in log_text.splitlines() if MEGATRON_WARNING in line and "clip_grads" in line]
    assert len(lines) <= 2, lines


# A Python dict printed whole (`{'key': ...`): the console keeps one line per fact, dicts go to the log file.
PYTHON_DICT = re.compile(r"\{'[^']*': ")


def first_run_noise(text: str) -> list[str]:
    """The lines of a clean run's console that a new user should not see: warnings (the embedded default's own
    choices are INFO) and whole Python dicts."""
    return [line for line in text.splitlines()
            if " WARNING " in line or line.startswith("relax-train: warning") or PYTHON_DICT.search(line)]


def _batch(lines, pid=123, actor="TrainerWorker", **extra):
    return {"lines": lines, "pid": pid, "ip": "10.0.0.1", "localhost": "10.0.0.1", "actor_name": actor,
            "task_name": "", "is_err": True, **extra}


@pytest.fixture
def log_file(tmp_path):
    path = tmp_path / "relax.log"
    handler = logging.FileHandler(path)
    yield path, handler
    handler.close()


def test_worker_output_sorts_lines(log_file):
    path, handler = log_file
    screen = io.StringIO()
    out = console.WorkerOutput(handler, console=screen)
    tq = "2026-12-02 17:39:{:02d},906 - WARNING - transfer_queue.utils.common - target_num_threads 8 should not exceed"
    out(_batch([tq.format(s) for s in range(5)], pid=9, actor="SimpleStorageUnit"))
    out(_batch([tq.format(9)], pid=10, actor="SimpleStorageUnit"))  # another unit: still a repeat
    out(_batch(["/x/megatron/core/optimizer/__init__.py:24: UserWarning: Transformer Engine and Apex are not "
                "installed.", "  warnings.warn("]))
    relax_warning = "2026-12-02 17:40:00,001 relax.rollout.rewards.runner WARNING reward failed for group 3"
    out(_batch([relax_warning], actor="RolloutManager"))
    out(_batch(["rollout 1:   0%|          | 0/512 [00:00<?, ?it/s]", "rollout 1:  62%|######2   | 320/512",
                "                                                  "], actor="RolloutManager"))
    out(_batch(["Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: boom"]))
    out(_batch(["Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: boom"]))
    out(_batch(["======== Autoscaler status ========"], pid="autoscaler", actor=""))
    out.close()
    shown = screen.getvalue().splitlines()
    assert shown == [relax_warning, "rollout 1:   0%|          | 0/512 [00:00<?, ?it/s]",
                     "rollout 1:  62%|######2   | 320/512"]
    assert not foreign_lines(screen.getvalue())
    text = path.read_text()
    assert text.count("target_num_threads") == 1 and "(SimpleStorageUnit pid=9) 2026-12-02" in text
    assert "(TrainerWorker pid=123) /x/megatron/core/optimizer/__init__.py:24: UserWarning" in text
    assert text.count("  warnings.warn(") == 1 and relax_warning in text
    assert text.count("ValueError: boom") == 2  # tracebacks are written whole, every time
    assert "Autoscaler" not in text and "rollout 1" not in text
    assert "workers printed 14 line(s) that are not Relax's; 9 distinct" in text, text


def test_route_holds_driver_warnings_and_keeps_the_console_for_relax(tmp_path, capsys):
    held = console.hold_warnings()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = held._hold  # catch_warnings saved the original; hold inside it
            warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
            assert held.held and capsys.readouterr().err == ""
            log = tmp_path / "logs" / "relax.log"
            with console.route(log, held):
                logging.getLogger("relax.test").warning("a warning of Relax's")
                logging.getLogger("transfer_queue.client").warning("a library's warning")
                warnings.warn("a warning during the run", DeprecationWarning)
    finally:
        held.restore()
    err = capsys.readouterr().err
    assert "a warning of Relax's" in err and "library" not in err and "Apex" not in err, err
    assert not foreign_lines(err)
    text = log.read_text()
    for words in ("Apex is not installed", "a warning of Relax's", "a library's warning", "a warning during the run"):
        assert words in text, words
    # everything is put back: the root logger's handlers and Python's warning display
    assert not any(isinstance(h, console.ConsoleHandler) for h in logging.getLogger().handlers)
    assert warnings.showwarning is held._original


def test_details_go_to_the_log_file_only(tmp_path, capsys):
    log = tmp_path / "relax.log"
    with console.route(log):
        logging.getLogger("relax.models.embedded").info("embedded default: tiny model in m (from the cache)")
        logging.getLogger(console.DETAILS).info("embedded default assets: %s", {"cache": "hit", "seed": 0})
    err = capsys.readouterr().err
    assert "tiny model in m" in err and "assets" not in err and not first_run_noise(err), err
    assert "embedded default assets: {'cache': 'hit', 'seed': 0}" in log.read_text()
    assert first_run_noise("x relax WARNING y\nrelax INFO a dict {'a': 1}\nrelax INFO fine") == [
        "x relax WARNING y", "relax INFO a dict {'a': 1}"]


def test_ray_output_goes_through_relax_and_is_put_back(tmp_path, capsys):
    """Ray's driver binds `print_to_stdstream` when ray.init connects; within `route_ray_output` it is
    Relax's, and Ray's own logger writes to the log file only."""
    before = ray_worker.print_to_stdstream
    ray_handlers = list(logging.getLogger("ray").handlers)
    log = tmp_path / "relax.log"
    with console.route(log) as output, route_ray_output(output):
        assert ray_worker.print_to_stdstream is output
        logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
        ray_worker.print_to_stdstream(_batch(["(some library) notice"]), ignore_prefix=False)
    assert ray_worker.print_to_stdstream is before
    assert logging.getLogger("ray").handlers == ray_handlers
    assert capsys.readouterr().err == ""
    text = log.read_text()
    assert "Started a local Ray instance." in text and "(TrainerWorker pid=123) (some library) notice" in text


def test_worker_setup_hook_gives_relax_records_the_driver_shape(capsys, monkeypatch):
    log = logging.getLogger("relax")
    monkeypatch.setattr(log, "handlers", [])
    monkeypatch.setattr(log, "propagate", True)
    console.setup_worker()
    console.setup_worker()  # once only
    logging.getLogger("relax.roles.rollout").warning("an engine was replaced")
    logging.getLogger("relax.roles.rollout").info("not shown")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and console.RELAX_RECORD.match(err[0]) and err[0].endswith("an engine was replaced")
    assert not foreign_lines("\n".join(err))


def test_on_a_terminal_the_bar_is_redrawn_in_place_and_cleared_before_other_lines(log_file):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    path, handler = log_file
    screen = Terminal()
    out = console.WorkerOutput(handler, console=screen)
    out(_batch(["rollout 0:   0%|          | 0/512", "rollout 0:  50%|#####     | 256/512"], actor="RolloutManager"))
    out(_batch(["2026-12-02 17:40:00,001 relax.roles.rollout WARNING an engine was replaced"], actor="RolloutManager"))
    out.close()
    assert screen.getvalue() == ("\rrollout 0:   0%|          | 0/512\x1b[K\rrollout 0:  50%|#####     | 256/512\x1b[K"
                                 "\r\x1b[K2026-12-02 17:40:00,001 relax.roles.rollout WARNING an engine was replaced\n")
