"""A stuck engine is named within a minute (issue 37, item 5), end to end: a real `relax-train` run (one embedded
engine) whose engine is SIGSTOPped mid-generation at step 1 by the test-only fault injection
(RELAX_TEST_ENGINE_FAULT, relax.rollout.fault_injection).

* Default flags but a shorter watch (--engine-liveness-timeout 15; the default, 60 s, is checked at parse in
  tests/test_engine_liveness.py): the liveness watch names the engine on the console within the timeout and one
  check interval of the stop, and the run stops with exit 1 and one line naming the engine, its address and the
  step, within 45 s of naming it: with the default 60 s, within 120 s of the stop (the per-request deadline,
  --generate-timeout, is 600 s). Waiting out the default itself would add ~45 s to the suite and test nothing more.
* --use-fault-tolerance: the watch hands the engine to the health monitor, which replaces it; the run finishes
  with every sample of the step. The watch's timeout is set below the monitor's probe timeout (30 s) here, so
  that the watch, not the monitor's own probe, is what finds the engine.

Each run is 2 steps of a few small prompts; every process of the run (the stopped engine included) is gone at
the end, and any that is not is resumed and killed so that nothing leaks into later tests."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import psutil
import pytest

from conftest import shared_tiny_model
from run_helpers import assert_nothing_left, failure_lines, log_time, start_run

from relax.models.tasks import generate_task_dataset

pytestmark = pytest.mark.e2e  # whole runs: Ray, trainer, engine (deselect with -m 'not e2e')

BATCH, N = 2, 4
FAULT = "hang:engine=0:step=1"
INJECTED = re.compile(r"test fault injection: hang engine (http://\S+) at step 1")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """The arguments of a 2-step run of the tests' tiny model, whose random weights seldom end a response early:
    each step's requests generate their 128 tokens, long enough for the stop to hit them in flight."""
    base = tmp_path_factory.mktemp("liveness")
    data = generate_task_dataset(base / "train.jsonl", 16, seed=0, task="add_mod10")
    return base, ["--hf-checkpoint", str(shared_tiny_model()), "--prompt-data", str(data), "--apply-chat-template",
                  "--input-key", "input", "--label-key", "label", "--rm-type", "random",
                  "--num-rollout", "2", "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N),
                  "--rollout-max-response-len", "128", "--micro-batch-size", str(BATCH * N),
                  "--resource", '{"actor": [1, 1], "rollout": [1, 1]}', "--distributed-backend", "gloo"]


class Console:
    """The run's console (stderr), read line by line as it comes, and every process the run started."""

    def __init__(self, proc):
        self.proc = proc
        self.lines: list[str] = []
        self.processes: dict[int, psutil.Process] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:  # a progress bar's redraws (\r) may share a line with a record
            self.lines.extend(part for part in line.rstrip("\n").split("\r") if part.strip())

    def _note_processes(self) -> None:
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.processes.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass

    def wait(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._note_processes()  # the replacement engine starts mid-run
            time.sleep(0.5)
        if self.proc.poll() is None:
            raise AssertionError(f"the run did not end within {timeout_s} s:\n" + self.text[-4000:])
        self._reader.join(timeout=10)
        return self.proc.returncode

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def find(self, pattern: str) -> list[str]:
        """The records whose message matches `pattern`, each from its time stamp on (a progress bar drawn without
        a new line may stand before it)."""
        record = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} relax\S* [A-Z]+ .*?" + pattern)
        return [m.group(0) + line[m.end():] for line in self.lines for m in [record.search(line)] if m]

    def cleanup(self) -> None:
        """Resume (a stopped process cannot act on SIGTERM) and kill whatever of the run is left."""
        if self.proc.poll() is None:
            self.proc.kill()
        for p in self.processes.values():
            try:
                p.send_signal(signal.SIGCONT)
                p.kill()
            except psutil.NoSuchProcess:
                pass


def run_with_hung_engine(base, args, name, *extra) -> tuple[Console, int, str, float]:
    """Run with engine 0 SIGSTOPped at step 1; returns (console, exit code, the engine's URL, the stop's time)."""
    proc = start_run(base / name, *args, *extra, env={"RELAX_TEST_ENGINE_FAULT": FAULT})
    console = Console(proc)
    try:
        code = console.wait(timeout_s=600)
        processes = list(console.processes.values())
    finally:
        console.cleanup()
    injected = console.find(INJECTED.pattern)
    assert injected, console.text[-4000:]
    url = INJECTED.search(injected[0]).group(1)
    assert_nothing_left(processes)
    return console, code, url, log_time(injected[0])


WATCH_S = 15.0  # --engine-liveness-timeout of the first test
DEFAULT_WATCH_S, DEFAULT_BOUND_S = 60.0, 120.0  # the flag's default, and the stop it must give a default run


def test_a_stopped_engine_ends_the_run_naming_it_after_the_liveness_timeout(small_run):
    base, args = small_run
    console, code, url, stopped = run_with_hung_engine(base, args, "default", "--engine-liveness-timeout",
                                                       f"{WATCH_S:g}")
    ended = time.time()
    assert code == 1, console.text[-4000:]
    # named on the console by the watch, after the timeout's silence (plus at most one check interval)
    (named,) = console.find(rf"(?<=WARNING )engine 0 \({re.escape(url)}\) has answered neither")
    assert "rollout step 1" in named and "stopping the run" in named, named
    detected = log_time(named) - stopped
    assert WATCH_S - 5.0 <= detected < WATCH_S + 15.0, (detected, named)
    # then one line: the engine, its address and the step
    lines = failure_lines(console.text)
    assert len(lines) == 1, console.text[-4000:]
    line = lines[0]
    assert f"engine 0 ({url})" in line and "step 1" in line and f"--engine-liveness-timeout {WATCH_S:g}" in line, line
    assert "EngineUnresponsive" in line, line
    assert "Traceback" not in console.text, console.text[-4000:]
    # with the default timeout the same run would end within DEFAULT_BOUND_S of the stop: the detection's slack
    # beyond the timeout and the stop after naming do not depend on the timeout
    stopping = ended - log_time(named)
    assert (detected - WATCH_S) + DEFAULT_WATCH_S + stopping < DEFAULT_BOUND_S, (detected, stopping)
    print(f"--engine-liveness-timeout {WATCH_S:g}: named {detected:.1f} s after the stop, run ended "
          f"{stopping:.1f} s after naming it")


def test_with_fault_tolerance_the_stopped_engine_is_replaced_and_the_run_finishes(small_run):
    base, args = small_run
    console, code, url, stopped = run_with_hung_engine(base, args, "ft", "--use-fault-tolerance",
                                                       "--engine-liveness-timeout", "20")
    assert code == 0, console.text[-4000:]
    (named,) = console.find(rf"(?<=WARNING )engine 0 \({re.escape(url)}\) has answered neither")
    assert "replacing it (--use-fault-tolerance)" in named, named
    detected = log_time(named) - stopped
    assert 18.0 <= detected < 30.0, (detected, named)
    replaced = console.find(r"kind=engine_replaced .*old_url=" + re.escape(url))
    assert replaced, console.text[-4000:]
    records = [json.loads(line) for line in (base / "ft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["samples/to_train"] == r["samples/trained"] == BATCH * N for r in records), records
    assert records[1]["engines/failed"] == 1, records[1]
    assert "Traceback" not in console.text, console.text[-4000:]
    print(f"--use-fault-tolerance: named {detected:.1f} s after the stop, replaced "
          f"{log_time(replaced[0]) - stopped:.1f} s after it")
