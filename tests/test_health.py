"""The HealthManager's parts that need no Ray (relax.core.health, health_restart, health_faults): when a rank is
silent, what its process is (real processes, stopped and killed), the failure line, the restart ledger and its
final line, metrics.jsonl truncation to the checkpoint step, where a restart resumes, the test fault's
format, a watch ending a bounded wait long before its deadline, and the health flags refused by parse_config
(exit 2 from relax-train) before Ray starts."""

import json
import os
import signal
import subprocess
import time
from types import SimpleNamespace

import psutil
import pytest
from conftest import relax_cli

from relax.formats.checkpoint_layout import MARKER
from relax.config import ConfigError, parse_config
from relax.config.rules_training import heartbeat_error
from relax.observability import heartbeat
from relax.core.calls import run_bounded, set_watch
from relax.core.deadlines import Call, RoleFailure, console_line
from relax.core.health import HealthManager, process_state, silent_entries, silent_failure
from relax.observability.heartbeat import BOARD_META
from relax.health_faults import RankFault
from relax.core.health_restart import (ATTEMPT_META, RestartLedger, attempt_config, resume_point, step_records,
                                       truncate_metrics)


def _entry(age, pid=1, role="trainer", rank=1):
    return {"role": role, "rank": rank, "pid": pid, "node": "10.0.0.1", "t": 0.0, "age_s": age}


def test_silent_after_timeout():
    latest = [_entry(0.5, rank=0), _entry(2.0, rank=1)]
    assert silent_entries(latest, since_poll_s=0.0, timeout_s=3.0) == []
    # the board was polled 1.5 s ago: rank 1's last beat is now 3.5 s old
    silent = silent_entries(latest, since_poll_s=1.5, timeout_s=3.0)
    assert [e["rank"] for e in silent] == [1] and silent[0]["age_s"] == pytest.approx(3.5)


def test_process_state_tells_hung_from_dead():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert "silent (hung)" in process_state(proc.pid, "n", "n")  # alive, running or sleeping
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(proc.pid, "n", "n") == f"process {proc.pid} is stopped (hung)"
        proc.kill()
        proc.wait()
        assert process_state(proc.pid, "n", "n") == f"process {proc.pid} is gone (dead)"
        assert "another node" in process_state(proc.pid, "other", "n")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_silent_failure_names_role_rank_step_and_call():
    entry = {**_entry(7.25, pid=999999999), "node": "n"}
    calls = [Call("trainer", "train step", rank=0, step=4), Call("trainer", "train step", rank=1, address="n pid 9",
                                                                  step=4)]
    failure = silent_failure(entry, 5.0, "n", calls)
    assert failure.call is calls[1]
    assert str(failure) == ("trainer rank 1 (n pid 9), step 4, train step: WorkerSilent: no heartbeat for 7.2 s "
                            "(--heartbeat-timeout 5): process 999999999 is gone (dead)")
    # a rank that is not among the calls waited for (e.g. silent while the rollout runs)
    other = silent_failure({**entry, "role": "critic", "rank": 0}, 5.0, "n", [Call("rollout", "generate", step=2)])
    assert str(other).startswith("critic rank 0 (n pid 999999999), step 2, heartbeat (while waiting for generate):")


def test_watch_ends_a_bounded_wait_before_its_deadline():
    def watch(calls):
        raise RoleFailure(calls[0], RuntimeError("silent"))

    set_watch(watch)
    t0 = time.monotonic()
    try:
        with pytest.raises(RoleFailure, match="silent"):
            run_bounded(lambda: time.sleep(30), Call("reference", "log-probs", step=1), deadline_s=60, flag="--x")
    finally:
        set_watch(None)
    assert time.monotonic() - t0 < 2


def test_ledger_gives_up_naming_counts():
    ledger = RestartLedger(1)
    first = RoleFailure(Call("trainer", "train step", rank=1, step=2), RuntimeError("ActorDiedError: gone"))
    assert ledger.record(first) == "trainer rank 1" and not ledger.exhausted
    ledger.restarts += 1
    second = RoleFailure(Call("trainer", "old log-probs", rank=1, step=2), RuntimeError("gone again"))
    ledger.record(second)
    assert ledger.exhausted
    line = console_line(ledger.give_up(second))
    assert line == ("run failed: trainer rank 1, step 2, old log-probs: RuntimeError: gone again; gave up after "
                    "1 restart (--max-global-restart 1): trainer rank 1 failed 2 times")
    # a failure that is not a role's call is named by its type
    ledger = RestartLedger(0)
    ledger.record(ValueError("x"))
    assert ledger.exhausted and "ValueError failed 1 time" in str(ledger.give_up(ValueError("x")))


def test_truncate_metrics_keeps_steps_before_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": 0, "eval/before_train": 1.0}, {"step": 0, "samples/trained": 8.0},
               {"step": 1, "samples/trained": 8.0}, {"step": 2, "samples/trained": 8.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    kept, discarded = truncate_metrics(path, 1)
    assert [r["step"] for r in kept] == [0, 0] and [r["step"] for r in discarded] == [1, 2]
    assert [json.loads(x) for x in path.read_text().splitlines()] == kept
    assert step_records(kept) == [records[1]]  # the evaluation record holds no sample accounting
    assert truncate_metrics(path, 5) == (kept, [])  # nothing after step 5: the file is left as it is
    assert truncate_metrics(tmp_path / "none.jsonl", 0) == ([], [])


def test_resume_point_and_attempt_config(tmp_path):
    save = tmp_path / "ckpt"
    config = parse_config(["--output-dir", str(tmp_path / "out"), "--save", str(save), "--use-health-check",
                           "--start-rollout-id", "0"])
    assert resume_point(config) == (None, None)  # no checkpoint yet: step 0
    save.mkdir()
    (save / "iter_0000003").mkdir()
    (save / MARKER).write_text("3")
    assert resume_point(config) == (str(save), 3)
    first, second = attempt_config(config, 0, config.load), attempt_config(config, 1, str(save))
    assert first.meta[ATTEMPT_META] == 0 and first.start_rollout_id == 0 and first.load is None
    assert second.meta[ATTEMPT_META] == 1 and second.load == str(save) and second.start_rollout_id is None
    assert first.meta[BOARD_META] != second.meta[BOARD_META]  # each attempt's ranks beat to a board of its own


def test_rank_fault_format_and_attempts():
    fault = RankFault.parse("hang:rank=0:step=2:call=train:times=2")
    assert (fault.kind, fault.role, fault.rank, fault.step, fault.call, fault.times) == ("hang", "trainer", 0, 2,
                                                                                         "train", 2)
    assert not fault.matches("trainer", "forward old log-probs", 2, attempt=0)
    assert not fault.matches("trainer", "train train step", 1, attempt=0)
    assert fault.matches("trainer", "train train step", 2, attempt=0)
    fault.fired.append({"attempt": 0, "pid": 1, "t": 1.0})
    assert not fault.matches("trainer", "train train step", 2, attempt=0)  # once per attempt
    assert fault.matches("trainer", "train train step", 2, attempt=1)
    fault.fired.append({"attempt": 1, "pid": 1, "t": 2.0})
    assert not fault.matches("trainer", "train train step", 2, attempt=2) and fault.last_fired_at() == 2.0
    assert RankFault.parse("kill:rank=1:step=0:role=critic").role == "critic"
    for bad in ("stop:rank=0:step=0", "kill:step=0", "kill:rank=0:step=0:role=rollout", "kill:rank=0:step=0:x=1"):
        with pytest.raises(ValueError, match="RELAX_TEST_TRAINER_FAULT"):
            RankFault.parse(bad)


def test_rank_fault_signals_a_real_process():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        fault = RankFault.parse("kill:rank=0:step=0:delay=0")
        fault.fire(proc.pid, attempt=0).join(5)
        assert proc.wait(timeout=5) == -signal.SIGKILL and fault.last_fired_at() is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_describe_tells_a_rank_stuck_in_its_call_from_a_silent_one():
    # the manager's view after a poll (its board and poll thread need Ray; describe reads only this state)
    manager = object.__new__(HealthManager)
    manager.timeout_s, manager.here, manager.polled_at = 5.0, "n", time.monotonic()
    manager.latest = [{**_entry(0.4, pid=999999999, rank=0), "node": "n"},
                      {**_entry(9.0, pid=999999999, rank=1), "node": "n"}]
    assert manager.describe("trainer", 0).startswith("trainer rank 0 is alive (last heartbeat 0.4 s ago): hung in")
    assert manager.describe("trainer", 1) == "trainer rank 1: process 999999999 is gone (dead)"
    assert manager.describe("critic", 0) == "critic rank 0 never sent a heartbeat"


@pytest.mark.parametrize("argv, message", [
    (["--heartbeat-interval", "1", "--heartbeat-timeout", "1"],
     "--heartbeat-timeout 1 must be at least twice --heartbeat-interval 1, so that one late heartbeat does not fail "
     "a healthy worker: raise --heartbeat-timeout to 2 or more, or lower --heartbeat-interval to 0.5 or less"),
    (["--heartbeat-interval", "20"],  # the default timeout (30) is no longer twice the period
     "--heartbeat-timeout 30 must be at least twice --heartbeat-interval 20"),
    (["--heartbeat-interval", "0"], "--heartbeat-interval must be a finite number of seconds > 0, got 0.0"),
    (["--heartbeat-interval", "-1"], "--heartbeat-interval must be a finite number of seconds > 0, got -1.0"),
    (["--heartbeat-timeout", "0"], "--heartbeat-timeout must be a finite number of seconds > 0, got 0.0"),
    (["--heartbeat-timeout", "nan"], "--heartbeat-timeout must be a finite number of seconds > 0, got nan"),
    (["--heartbeat-timeout", "inf"], "--heartbeat-timeout must be a finite number of seconds > 0, got inf"),
    (["--max-global-restart", "-1"], "--max-global-restart must be >= 0, got -1"),
])
def test_bad_health_settings_fail_at_parse(tmp_path, argv, message):
    with pytest.raises(ConfigError) as info:
        parse_config(["--output-dir", str(tmp_path), "--use-health-check", *argv])
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("flag, value", [("--heartbeat-interval", "2"), ("--heartbeat-timeout", "10"),
                                         ("--max-global-restart", "1")])
def test_health_flags_need_use_health_check(tmp_path, flag, value):
    with pytest.raises(ConfigError, match=f"^{flag} configures the HealthManager of --use-health-check: add "
                                          f"--use-health-check \\(or drop {flag}\\)$"):
        parse_config(["--output-dir", str(tmp_path), flag, value])
    # at its default (as a --dry-run's resolved config restates it) the flag is no user choice
    parse_config(["--output-dir", str(tmp_path), "--heartbeat-interval", "1", "--max-global-restart", "3"])


def test_good_health_settings_parse(tmp_path):
    # exactly twice the period; no restarts allowed (detect and name only); no --save: a restart starts at step 0
    config = parse_config(["--output-dir", str(tmp_path), "--use-health-check", "--heartbeat-interval", "0.5",
                           "--heartbeat-timeout", "1", "--max-global-restart", "0"])
    assert (config.heartbeat_interval, config.heartbeat_timeout, config.max_global_restart) == (0.5, 1.0, 0)
    assert heartbeat_error(1.0, 30.0) is None  # the defaults


def test_bad_health_settings_exit_2_before_ray(tmp_path):
    proc = relax_cli("--output-dir", str(tmp_path), "--use-health-check", "--heartbeat-timeout", "1", timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "relax-train: error: --heartbeat-timeout 1 must be at least twice --heartbeat-interval 1, so that one late "
        "heartbeat does not fail a healthy worker: raise --heartbeat-timeout to 2 or more, or lower "
        "--heartbeat-interval to 0.5 or less")
    assert "Traceback" not in proc.stderr and not (tmp_path / "logs").exists()  # nothing was started


def test_rollout_manager_fault_format():
    fault = RankFault.parse("hang:role=rollout:step=1:call=generate")
    assert (fault.kind, fault.role, fault.rank, fault.step, fault.target) == ("hang", "rollout", None, 1, "rollout")
    assert fault.matches("rollout", "generate generate", 1, attempt=0)
    assert not fault.matches("rollout", "evaluate evaluation", 1, attempt=0)
    assert not fault.matches("trainer", "generate generate", 1, attempt=0)
    assert RankFault.parse("kill:rank=1:step=0").target == "trainer rank 1"
    for bad in ("kill:role=rollout:rank=0:step=1", "kill:role=rollout", "kill:step=1:role=engine"):
        with pytest.raises(ValueError, match="RELAX_TEST_TRAINER_FAULT"):
            RankFault.parse(bad)


def test_silent_rollout_manager_is_named_at_its_call():
    # the manager beats with rank None, as the controller's calls into it name it (Call("rollout", ...))
    entry = {**_entry(4.5, pid=999999999, role="rollout", rank=None), "node": "n"}
    failure = silent_failure(entry, 4.0, "n", [Call("rollout", "generate", step=1)])
    assert str(failure) == ("rollout (n pid 999999999), step 1, generate: WorkerSilent: no heartbeat for 4.5 s "
                            "(--heartbeat-timeout 4): process 999999999 is gone (dead)")
    # silent while the driver waits for the trainer: named with the call it waits for
    other = silent_failure(entry, 4.0, "n", [Call("trainer", "train step", rank=0, step=3)])
    assert str(other).startswith("rollout (n pid 999999999), step 3, heartbeat (while waiting for train step):")
    manager = object.__new__(HealthManager)
    manager.timeout_s, manager.here, manager.polled_at, manager.latest = 4.0, "n", time.monotonic(), [entry]
    assert manager.lost_ranks() == [("rollout", "process 999999999 is gone (dead)")]
    assert manager.describe("rollout", None) == "rollout: process 999999999 is gone (dead)"
    assert manager.pid_of("rollout", None) == (999999999, "n")
    ledger = RestartLedger(0)
    ledger.record(failure)
    assert "rollout failed 1 time" in str(ledger.give_up(failure))


def test_rollout_manager_heartbeat_thread(monkeypatch, tmp_path):
    """start_heartbeat(role="rollout") beats (role, None, pid, node) from a thread of its own, only with
    --use-health-check (the board here is a stand-in: Ray's actor lookup is replaced)."""
    beats, gone = [], []

    class Board:
        class beat:  # noqa: N801 - the actor method's `.remote`
            @staticmethod
            def remote(*args):
                if gone:  # as a killed board: the thread ends
                    raise RuntimeError("the board is gone")
                beats.append(args)

    monkeypatch.setattr(heartbeat.ray, "get_actor", lambda name: Board)
    monkeypatch.setattr(heartbeat.ray.util, "get_node_ip_address", lambda: "n")
    off = parse_config(["--output-dir", str(tmp_path)])
    assert heartbeat.start_heartbeat(SimpleNamespace(config=off), role="rollout") is None
    on = parse_config(["--output-dir", str(tmp_path), "--use-health-check", "--heartbeat-interval", "0.05",
                       "--heartbeat-timeout", "1"])
    on = attempt_config(on, 0, None)  # the attempt's board name, as the controller sets it
    thread = heartbeat.start_heartbeat(SimpleNamespace(config=on), role="rollout")
    deadline = time.monotonic() + 5
    while len(beats) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    gone.append(True)
    thread.join(5)
    assert thread.daemon and not thread.is_alive() and len(beats) >= 3
    assert beats[0] == ("rollout", None, os.getpid(), "n")
