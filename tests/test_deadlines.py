"""Nothing hangs, and a failure is one line (issue 15, items 2 and 3), in its parts that need no run:
deadlines derived from the flags, the console line of a failed or overdue call, how samples and rewards
are named, the stop on a step whose every reward failed, and the process-level guarantees (a request to a
server that never answers fails by its deadline, naming the flag; a SIGSTOPped server is stopped at once;
a driver-side wait gives way to a signal at once). End-to-end runs: tests/test_run_deadlines.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import ray

from relax.wire.engine_client import EngineClient, EngineRequestError
from relax.wire.net import ManagedProcess
from relax.config import parse_config
from relax.core.calls import run_bounded, stop_processes
from relax.core.deadlines import Call, Deadlines, RoleFailure, cause_text, console_line
from relax.data.sample import Sample
from relax.rollout.context import RolloutContext
from relax.rollout.rewards.runner import (
    AllRewardsFailedError,
    RewardError,
    RewardRunner,
    check_step_rewards,
    reward_name,
)


# ------------------------------------------------------------------ deadlines from the flags
def test_deadlines_come_from_the_flags_with_documented_defaults(tmp_path):
    config = parse_config(["--output-dir", str(tmp_path)])
    d = Deadlines.from_config(config)
    assert (d.generate_s, d.weight_update_s, d.control_s, d.reward_s, d.train_s) == (600.0, 300.0, 60.0, 600.0,
                                                                                     3600.0)
    assert d.shutdown_s == 10.0  # a stopping run stays prompt whatever the control deadline
    config = parse_config(["--output-dir", str(tmp_path), "--generate-timeout", "7", "--weight-update-timeout", "3",
                           "--engine-control-timeout", "2", "--reward-timeout", "0", "--train-step-timeout", "0"])
    d = Deadlines.from_config(config)
    assert (d.generate_s, d.weight_update_s, d.control_s, d.reward_s, d.train_s) == (7.0, 3.0, 2.0, None, None)
    assert d.shutdown_s == 2.0
    # every engine request of a rollout step takes --generate-timeout unless the caller gives its own
    assert RolloutContext(args=config, tokenizer=None).timeout_s == 7.0
    assert RolloutContext(args=config, tokenizer=None, timeout_s=1.5).timeout_s == 1.5


# ------------------------------------------------------------------ the one console line
def test_a_failed_call_is_one_line_naming_role_rank_address_step_and_cause():
    call = Call("trainer", "weight push", rank=0, address="10.0.0.5 pid 42", step=3)
    try:
        raise RuntimeError("engine http://127.0.0.1:9/update_weights_from_tensor failed: timed out\n"
                           "--- server log tail ---\nTraceback (most recent call last):\n  boom")
    except RuntimeError as exc:
        failure = RoleFailure(call, exc)
    text = str(failure)
    assert text == ("trainer rank 0 (10.0.0.5 pid 42), step 3, weight push: RuntimeError: engine "
                    "http://127.0.0.1:9/update_weights_from_tensor failed: timed out")
    line = console_line(failure, "/runs/x/logs/relax.log")
    assert "\n" not in line and line.startswith("run failed: trainer rank 0") and line.endswith(
        "(traceback in /runs/x/logs/relax.log)")
    failure.add_detail("engine http://127.0.0.1:9 does not answer /health within 5 s")
    assert str(failure).endswith("; engine http://127.0.0.1:9 does not answer /health within 5 s")


def test_an_overdue_call_names_every_rank_still_running_and_the_flag():
    calls = [Call("trainer", "train step", rank=r, address=f"h pid {r}", step=5) for r in (1, 3)]
    failure = RoleFailure(calls[0], timeout_s=2.5, flag="--train-step-timeout", waiting=calls)
    assert failure.timed_out
    assert str(failure) == ("trainer rank 1 (h pid 1), trainer rank 3 (h pid 3), step 5, train step: "
                            "no answer within 2.5 s (--train-step-timeout)")


def test_the_cause_of_an_actor_error_is_the_error_raised_inside_the_actor():
    try:
        raise ValueError("bad shape\nsecond line")
    except ValueError as inner:
        wrapped = ray.exceptions.RayTaskError("TrainerWorker.train", "Traceback (most recent call last):\n ...",
                                              inner).as_instanceof_cause()
    assert cause_text(wrapped) == "ValueError: bad shape"
    assert cause_text(ray.exceptions.ActorDiedError()) == ("ActorDiedError: The actor died unexpectedly before "
                                                            "finishing this task.")
    assert cause_text(RuntimeError("")) == "RuntimeError"
    long = cause_text(RuntimeError("x" * 2000))
    assert len(long) < 450 and long.endswith(" ...")
    assert console_line(KeyError("k")) == "run failed: KeyError: 'k'"


# ------------------------------------------------------------------ samples and rewards are named
def test_samples_are_named_by_group_place_prompt_row_and_step_never_minus_one():
    s = Sample(group_index=7, metadata={"prompt_index": 12}, rollout_step=3)
    assert s.index == -1  # the global index comes once the step's rollout is complete
    assert s.describe() == "a sample of group 7 (prompt row 12, step 3)"
    assert s.describe(2) == "sample 2 of group 7 (prompt row 12, step 3)"
    s.index = 41
    assert s.describe(2) == "sample 41 of group 7 (prompt row 12, step 3)"


def test_a_reward_failure_names_the_sample_of_the_rollout_and_the_reward_server():
    def boom(args, sample):
        raise ZeroDivisionError("bad")

    group = [Sample(group_index=4, metadata={"prompt_index": 9}, rollout_step=1, response_text=str(i))
             for i in range(3)]
    with pytest.raises(RewardError, match=r"^reward failed for sample 0 of group 4 \(prompt row 9, step 1\) "
                                          r"\(reward custom .*boom\): ZeroDivisionError: bad$"):
        RewardRunner(custom_fn=boom).score(group, group_size=3)
    with pytest.raises(RewardError, match=r"group 4 \(3 samples, prompt row 9, step 1\)"):
        RewardRunner(custom_fn=boom, group_rm=True).score([group])
    args = SimpleNamespace(custom_rm_path=None, rm_type="remote_rm", rm_url="http://rm:8000/score")
    assert reward_name(args) == "remote_rm at http://rm:8000/score"
    assert reward_name(SimpleNamespace(custom_rm_path="pkg.mod.fn", rm_type=None, rm_url=None)) == "custom pkg.mod.fn"


def test_a_step_whose_every_reward_failed_stops_and_partial_failures_are_counted():
    async def never(args, sample):
        await asyncio_event().wait()

    samples = [Sample(group_index=0, rollout_step=2, response_text="a") for _ in range(3)]
    start = time.monotonic()
    result = RewardRunner(custom_fn=never, timeout_s=0.2, on_error="zero").score(samples, group_size=3, assign=True)
    assert time.monotonic() - start < 5 and result.num_errors == 3
    with pytest.raises(AllRewardsFailedError, match=r"step 2: every reward failed \(3 of 3 samples, reward "
                                                    r"custom x.y; --reward-error-policy zero.*TimeoutError.*"
                                                    r"--reward-timeout"):
        check_step_rewards(samples, 2, "custom x.y")
    samples.append(Sample(group_index=1, rollout_step=2))
    assert check_step_rewards(samples, 2, "custom x.y") == 3
    assert check_step_rewards([Sample()], 2, "r") == 0


def asyncio_event():
    import asyncio

    return asyncio.Event()


# ------------------------------------------------------------------ processes and waits
def test_a_request_to_a_server_that_never_answers_fails_by_its_deadline_naming_the_flag():
    with socket.socket() as hang:  # accepts connections (backlog) but never answers
        hang.bind(("127.0.0.1", 0))
        hang.listen(8)
        url = f"http://127.0.0.1:{hang.getsockname()[1]}"
        client = EngineClient(url, timeout_s=0.5, deadline_flag="--engine-control-timeout")
        start = time.monotonic()
        with pytest.raises(EngineRequestError) as info:
            client.release_memory()
        assert time.monotonic() - start < 5
    assert info.value.timed_out
    assert str(info.value) == (f"engine request {url}/release_memory_occupation failed: timed out: no answer within "
                               "0.5 s (--engine-control-timeout)")


def _stopped_child() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def test_a_sigstopped_server_is_stopped_at_once():
    managed = ManagedProcess([sys.executable, "-c", "import time; time.sleep(600)"], name="sleeper").start()
    os.kill(managed.pid, signal.SIGSTOP)
    start = time.monotonic()
    managed.stop(timeout_s=30)  # SIGTERM alone stays pending on a stopped process until the 30 s run out
    assert time.monotonic() - start < 5 and not managed.is_alive()
    child = _stopped_child()
    start = time.monotonic()
    names = stop_processes([psutil.Process(child.pid)], grace_s=30)
    assert child.wait(timeout=5) is not None and time.monotonic() - start < 5
    assert names and "time.sleep(600)" in names[0]


def test_a_driver_side_wait_gives_way_to_a_signal_at_once_and_ends_by_its_deadline():
    release = threading.Event()
    call = Call("data plane (storage units)", "clear the step", step=4)
    start = time.monotonic()
    with pytest.raises(RoleFailure, match=r"data plane \(storage units\), step 4, clear the step: no answer within "
                                          r"0.5 s \(--engine-control-timeout\)"):
        run_bounded(release.wait, call, deadline_s=0.5, flag="--engine-control-timeout")
    assert time.monotonic() - start < 3

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            run_bounded(release.wait, call, deadline_s=None, flag="")
        assert time.monotonic() - start < 3
    finally:
        signal.signal(signal.SIGUSR1, previous)
        release.set()
    with pytest.raises(RoleFailure, match=r"clear the step: ValueError: nope"):
        run_bounded(lambda: (_ for _ in ()).throw(ValueError("nope")), call, deadline_s=5, flag="")


# ------------------------------------------------------------------ calls into actors (the session's Ray)
def test_calls_into_ranks_fail_fast_and_name_the_late_ranks(ray_session):
    from relax.core.calls import wait_all

    # Defined here: the workers cannot import a test module, the class travels by value. Threaded, so that a
    # rank still in an earlier call answers the next one.
    @ray.remote(num_cpus=0, max_concurrency=4)
    class Rank:
        def work(self, seconds: float) -> str:
            import time

            time.sleep(seconds)
            return "done"

        def boom(self) -> None:
            raise ValueError("rank failed\nwith a second line")

    ranks = [Rank.remote() for _ in range(3)]
    try:
        calls = [Call("trainer", "train step", rank=r, address=f"h pid {r}", step=2) for r in range(3)]
        assert wait_all([r.work.remote(0) for r in ranks], calls, deadline_s=60, flag="--train-step-timeout") == [
            "done"] * 3
        # an error is raised when it is known, not after the slowest rank
        start = time.monotonic()
        with pytest.raises(RoleFailure, match=r"^trainer rank 1 \(h pid 1\), step 2, train step: ValueError: "
                                              r"rank failed$"):
            wait_all([ranks[0].work.remote(30), ranks[1].boom.remote(), ranks[2].work.remote(0)], calls,
                     deadline_s=60, flag="--train-step-timeout")
        assert time.monotonic() - start < 10
        # past the deadline: every rank still running is named
        start = time.monotonic()
        with pytest.raises(RoleFailure) as info:
            wait_all([ranks[0].work.remote(0), ranks[1].work.remote(30), ranks[2].work.remote(30)], calls,
                     deadline_s=1.0, flag="--train-step-timeout")
        assert 1.0 <= time.monotonic() - start < 10
        assert str(info.value) == ("trainer rank 1 (h pid 1), trainer rank 2 (h pid 2), step 2, train step: "
                                   "no answer within 1 s (--train-step-timeout)")
    finally:
        for r in ranks:
            ray.kill(r)
