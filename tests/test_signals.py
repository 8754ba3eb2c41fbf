"""SIGINT and SIGTERM stop a real `relax-train` run cleanly: exit code 128 + signal, a log line, and no process of
the run (Ray, engines, router) left behind. SIGINT is ignored when the run starts, as it is for a
background job of a shell script, so the handler must be Relax's own."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest


def _wait_for_first_step(out: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        if metrics.is_file() and any('"step"' in line for line in metrics.read_text().splitlines()):
            return
        time.sleep(1)
    raise AssertionError("no training step within the timeout")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_the_run_and_leaves_no_process(tmp_path, signum):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "relax.entrypoints.train", "--output-dir", str(out), "--num-rollout", "100",
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "1"]

    def ignore_sigint():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ignore_sigint, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_for_first_step(out, proc)
        run_processes = psutil.Process(proc.pid).children(recursive=True)
        assert run_processes, "the run started no processes"
        proc.send_signal(signum)
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 128 + signum  # 130 for SIGINT, 143 for SIGTERM
    log = (out / "logs" / "relax.log").read_text()
    assert f"interrupted by {signal.Signals(signum).name}; shutting down" in log
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    assert steps and max(steps) < 99  # stopped early
    time.sleep(2)
    left = [p for p in run_processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"left behind: {[p.cmdline()[:3] for p in left]}"
    pids = {str(p.pid) for p in run_processes}
    segments = [f for f in os.listdir("/dev/shm") if f.startswith("relax-ws-") and f.split("-")[2] in pids]
    assert not segments, f"weight-sync segments left in /dev/shm: {segments}"
