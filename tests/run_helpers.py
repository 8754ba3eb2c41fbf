"""Helpers of the tests that run `relax-train` in a subprocess and make it fail or stop on purpose
(tests/test_signals.py, tests/test_run_deadlines.py): start a run on the embedded default, wait for a
marker that a reward hook writes, and check that nothing of the run is left afterwards.

The hooks are reward functions (`--custom-rm-path`), the real extension point, that inject the fault from
inside the run at a known moment: they stop the run's engine with SIGSTOP, or never return."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

HOOKS = '''
import asyncio, json, os, signal, time
import psutil

def _mark(name, **info):
    path = os.path.join(os.environ["RELAX_TEST_MARKS"], name)
    if not os.path.exists(path):
        with open(path, "w") as f:
            json.dump({"time": time.time(), **info}, f)

def stop_engine(args, sample):
    """Score 0 after SIGSTOPping the run's engine (found by its model folder): the next call into it hangs."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "relax.backends.embedded.server" in cmd and str(args.hf_checkpoint) in cmd:
            p.send_signal(signal.SIGSTOP)
            _mark("stopped", url="http://127.0.0.1:" + cmd[cmd.index("--port") + 1])
    return 0.0

async def never(args, sample):
    """A reward that never returns."""
    _mark("reward_called")
    await asyncio.Event().wait()

async def never_from_step_one(args, sample):
    """Scores step 0, then never returns (the rollout actor stays busy)."""
    if sample.rollout_step >= 1:
        await never(args, sample)
    return 1.0 if sample.response_text.strip() == str(sample.label).strip() else 0.0
'''


def write_hooks(tmp_path: Path) -> tuple[dict, Path]:
    """A module `relax_test_hooks` with the hooks above; returns (environment for the run, marker folder)."""
    hooks = tmp_path / "hooks"
    marks = tmp_path / "marks"
    hooks.mkdir()
    marks.mkdir()
    (hooks / "relax_test_hooks.py").write_text(HOOKS)
    path = os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "RELAX_TEST_MARKS": str(marks)}, marks


def start_run(out: Path, *args: str, env: dict | None = None, ignore_sigint: bool = False) -> subprocess.Popen:
    """`relax-train --output-dir OUT ARGS` on the embedded default; stderr is a pipe (the console)."""
    cmd = [sys.executable, "-m", "relax.entrypoints.train", "--output-dir", str(out), *args]

    def preexec():
        if ignore_sigint:  # as for a background job of a shell script
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=preexec,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early with {proc.returncode}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"{path.name} did not appear within {timeout} s")


def run_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    processes = psutil.Process(proc.pid).children(recursive=True)
    assert processes, "the run started no processes"
    return processes


def assert_nothing_left(processes: list[psutil.Process], settle_s: float = 5.0) -> None:
    """No process of the run is left (a stopped one counts), and no /dev/shm weight-sync segment of one."""
    deadline = time.monotonic() + settle_s
    while True:
        left = []
        for p in processes:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"left behind: {[(p.pid, p.status(), p.cmdline()[:4]) for p in left]}"
    pids = {str(p.pid) for p in processes}
    segments = [f for f in os.listdir("/dev/shm") if f.startswith("relax-ws-") and f.split("-")[2] in pids]
    assert not segments, f"weight-sync segments left in /dev/shm: {segments}"


def failure_lines(console: str) -> list[str]:
    return [line for line in console.splitlines() if "run failed:" in line]


def log_time(line: str) -> float:
    """The time of a log line (`YYYY-mm-dd HH:MM:SS,mmm ...`) as a Unix time."""
    import datetime

    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()
