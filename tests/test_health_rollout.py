"""The rollout manager's heartbeats (--use-health-check) on the shared Ray, without engines or a trainer: the real
`RolloutManager` actor beats into the attempt's board from its constructor on, and the HealthManager's watch
ends the driver's wait by the manager's name within --heartbeat-timeout

* when the manager is SIGSTOPped (hung) during a call into it: the call's own line, "stopped (hung)"; once
  resumed (SIGCONT) it beats again and is no longer silent;
* when it is SIGKILLed while the driver waits for something else (a trainer step): it is named with the call
  the driver waits for, "gone (dead)", without waiting for the next rollout call.

Both faults hit one manager (its start, importing transformers, takes most of the test's time).

The restart that follows is the same as for a trainer rank (relax.core.health_restart);
tests/test_health_e2e.py runs it for a hung rollout manager."""

import os
import re
import signal
import time

import pytest
import ray
from conftest import assert_ray_released, shared_ray, shared_tiny_model

from relax.config import parse_config
from relax.core.calls import run_bounded, set_watch, wait_all
from relax.core.deadlines import Call, RoleFailure
from relax.core.health import HealthManager
from relax.core.health_restart import attempt_config
from relax.models.tasks import generate_task_dataset
from relax.roles.rollout import RolloutManager

INTERVAL_S, TIMEOUT_S = 0.25, 2.0  # --heartbeat-interval, --heartbeat-timeout


def _wait_for(predicate, deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(0.1)


def _detected(kind: str, t0: float) -> float:
    detected_s = time.monotonic() - t0
    print(f"{kind}: rollout manager found silent {detected_s:.2f} s after the signal (--heartbeat-timeout "
          f"{TIMEOUT_S:g}, --heartbeat-interval {INTERVAL_S:g})")
    # its last beat was at most one interval before the signal; found within the board's poll period (at most
    # 1 s) and a wait slice after the timeout
    assert TIMEOUT_S - INTERVAL_S - 0.1 <= detected_s < TIMEOUT_S + 3.0
    return detected_s


def test_rollout_manager_hung_then_killed_is_found_by_name(tmp_path):
    shared_ray()
    data = str(generate_task_dataset(tmp_path / "train.jsonl", 4, seed=0, task="add_mod10"))
    config = attempt_config(parse_config([
        "--hf-checkpoint", str(shared_tiny_model()), "--prompt-data", data, "--input-key", "input",
        "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "2", "--num-rollout", "1",
        "--output-dir", str(tmp_path / "out"), "--use-health-check", "--heartbeat-interval", str(INTERVAL_S),
        "--heartbeat-timeout", str(TIMEOUT_S)]), 0, None)
    health = HealthManager(config)  # creates the attempt's board, as Controller.start does before the roles
    manager = RolloutManager.options(num_cpus=1).remote(config)
    try:
        _wait_for(lambda: health.pid_of("rollout", None) is not None, 120, "the manager never sent a heartbeat")
        pid, node = health.pid_of("rollout", None)
        assert ray.get(manager.get_engine_urls.remote(), timeout=120) == []  # the constructor has finished
        set_watch(health.watch)

        # hung (SIGSTOP) during a call into it, which has no deadline: only the heartbeats end the wait
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RoleFailure) as info:
            wait_all([manager.get_engine_urls.remote()], [Call("rollout", "engine urls", step=1)], deadline_s=None,
                     flag="")
        _detected("hang", t0)
        state = f"process {pid} is stopped (hung)"
        line = re.escape(f"rollout ({node} pid {pid}), step 1, engine urls: WorkerSilent: no heartbeat for ")
        line += r"\d+\.\d s " + re.escape(f"(--heartbeat-timeout {TIMEOUT_S:g}): {state}")
        assert re.fullmatch(line, str(info.value)), str(info.value)
        assert health.lost_ranks() == [("rollout", state)]

        # running again: it beats again and is no longer silent
        os.kill(pid, signal.SIGCONT)
        _wait_for(lambda: not health.silent(), 10, "the resumed manager is still silent")

        # killed while the driver waits for a trainer step: named with that call, before the next rollout call
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RoleFailure) as info:
            run_bounded(lambda: time.sleep(60), Call("trainer", "train step", rank=0, step=2), deadline_s=120,
                        flag="--train-step-timeout")
        _detected("kill", t0)
        state = f"process {pid} is gone (dead)"
        assert str(info.value).startswith(f"rollout ({node} pid {pid}), step 2, heartbeat (while waiting for train "
                                          "step): WorkerSilent: no heartbeat for ")
        assert str(info.value).endswith(state) and health.lost_ranks() == [("rollout", state)]
    finally:
        set_watch(None)
        health.kill_silent_ranks()  # a stopped process cannot act on Ray's kill
        ray.kill(manager)
        health.close()
    assert_ray_released()
