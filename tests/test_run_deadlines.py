"""Nothing hangs (issue 15, items 2 and 3), end to end on the embedded default: a SIGSTOPped engine and a
reward function that never returns each end a real `relax-train` run with a non-zero exit within their
deadlines (set short here by their flags), with one console line naming the component, its address and
what it was doing, and nothing of the run left behind (processes, /dev/shm segments).

The faults are injected from reward hooks (tests/run_helpers.py) at a known moment of step 0."""

from __future__ import annotations

import json
import time

from test_console import assert_console_clean
from run_helpers import (
    assert_nothing_left,
    failure_lines,
    log_time,
    run_processes,
    start_run,
    wait_for_file,
    write_hooks,
)

SMALL = ["--num-rollout", "1", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2"]


def _small(tmp_path) -> list[str]:
    """The smallest run that reaches the weight push: one prompt, two samples, no reference role (the
    embedded default's KL loss is switched off in a config file, since the preset sets it)."""
    no_kl = tmp_path / "no_kl.yaml"
    no_kl.write_text("use_kl_loss: false\nkl_loss_coef: 0.0\n")
    return [*SMALL, "--custom-config-path", str(no_kl)]


def _finish(proc, timeout: float) -> tuple[int, str, float]:
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, proc.stderr.read(), time.time()


def test_a_sigstopped_engine_stops_the_run_at_the_weight_push_naming_it(tmp_path):
    env, marks = write_hooks(tmp_path)
    out = tmp_path / "run"
    proc = start_run(out, *_small(tmp_path), "--custom-rm-path", "relax_test_hooks.stop_engine",
                     "--weight-update-timeout", "3", env=env)
    try:
        wait_for_file(marks / "stopped", proc)
        processes = run_processes(proc)
        code, console, ended = _finish(proc, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = json.loads((marks / "stopped").read_text())
    assert code == 1, console[-3000:]
    lines = failure_lines(console)
    assert len(lines) == 1, console[-3000:]
    line = lines[0]
    # the component, its address, what it was doing and the deadline's flag, in one line
    assert f"engine {stopped['url']}" in line and "weight push" in line and "trainer rank 0" in line, line
    assert "no answer within 3 s (--weight-update-timeout)" in line, line
    assert "Traceback" not in console, console[-3000:]
    # the push waited out its deadline (3 s) after the engine stopped, and no more than that plus the step's
    # training; the shutdown after it is bounded
    failed_at = log_time(line)
    assert 3.0 <= failed_at - stopped["time"] < 3.0 + 45, (failed_at - stopped["time"], line)
    assert ended - failed_at < 40, ended - failed_at
    assert_nothing_left(processes)
    log = (out / "logs" / "relax.log").read_text()
    assert "Traceback" in log  # the full story is in the log file
    assert_console_clean(console, log)  # and the libraries' warnings: the console holds Relax's lines only


def test_a_reward_that_never_returns_fails_by_its_deadline_and_an_all_failed_step_is_not_trained(tmp_path):
    env, marks = write_hooks(tmp_path)
    out = tmp_path / "run"
    proc = start_run(out, *_small(tmp_path), "--custom-rm-path", "relax_test_hooks.never", "--reward-timeout", "2",
                     "--reward-error-policy", "zero", env=env)
    try:
        wait_for_file(marks / "reward_called", proc)
        processes = run_processes(proc)
        code, console, ended = _finish(proc, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    called = json.loads((marks / "reward_called").read_text())["time"]
    assert code == 1, console[-3000:]
    lines = failure_lines(console)
    assert len(lines) == 1, console[-3000:]
    line = lines[0]
    assert "step 0" in line and "every reward failed (2 of 2 samples, reward custom relax_test_hooks.never" in line
    assert "did not return within 2 s (--reward-timeout)" in line, line
    assert "Traceback" not in console, console[-3000:]
    failed_at = log_time(line)
    assert 2.0 <= failed_at - called < 2.0 + 45, (failed_at - called, line)
    assert ended - failed_at < 40, ended - failed_at
    assert not (out / "metrics.jsonl").exists() or '"step"' not in (out / "metrics.jsonl").read_text()
    assert_nothing_left(processes)
    assert_console_clean(console, (out / "logs" / "relax.log").read_text())
