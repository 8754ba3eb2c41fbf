"""SIGINT and SIGTERM stop a real `relax-train` run cleanly and promptly: exit code 128 + signal, a log line,
and no process of the run (Ray, engines, router) left behind. The signal arrives while the rollout actor is
busy with a reward call that never returns (a hung call must not delay the stop: the driver waits in short
slices and the shutdown does not queue behind the busy actor). SIGINT is ignored when the run starts, as it
is for a background job of a shell script, so the handler must be Relax's own."""

import json
import signal
import time

import pytest
from run_helpers import assert_nothing_left, run_processes, start_run, wait_for_file, write_hooks

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')


# SIGTERM here; SIGINT (exit 130) with a hung call is tests/test_fully_async_e2e.py's, through the same handlers
@pytest.mark.parametrize("signum", [signal.SIGTERM])
def test_signal_during_a_hung_call_stops_the_run_promptly_and_leaves_no_process(tmp_path, signum):
    env, marks = write_hooks(tmp_path)
    out = tmp_path / "run"
    proc = start_run(out, "--num-rollout", "100", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                     "--num-steps-per-rollout", "1", "--custom-rm-path", "relax_test_hooks.never_from_step_one",
                     env=env, ignore_sigint=True)
    try:
        wait_for_file(marks / "reward_called", proc)  # step 0 is trained; step 1's reward hangs
        processes = run_processes(proc)
        sent = time.monotonic()
        proc.send_signal(signum)
        code = proc.wait(timeout=180)
        stopped_after = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 128 + signum  # 130 for SIGINT, 143 for SIGTERM
    assert stopped_after < 30, stopped_after  # before: ~60 s queued behind the busy rollout actor
    log = (out / "logs" / "relax.log").read_text()
    assert f"interrupted by {signal.Signals(signum).name}; shutting down" in log
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    assert steps == [0]  # stopped during step 1
    assert_nothing_left(processes)
