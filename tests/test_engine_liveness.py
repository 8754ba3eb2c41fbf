"""The liveness watch of the rollout engines (--engine-liveness-timeout): its bookkeeping with a fake clock
(relax.rollout.liveness), then the watch itself (relax.rollout.engine_watch) over a real embedded engine server,
without Ray: a SIGSTOPped engine is named within the timeout and a step waiting on it ends at once, while an
engine that is idle or busy generating is never named. The end-to-end runs are in test_engine_liveness_e2e.py."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import requests

from conftest import shared_tiny_model

from relax.backends.embedded.launcher import EmbeddedServerProcess
from relax.rollout.engine_pool import ACTIVE, Engine, EnginePool
from relax.rollout.engine_watch import EngineWatcher
from relax.rollout.liveness import EngineUnresponsive, LivenessWatch


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def test_silence_counts_only_with_requests_in_flight(clock):
    watch = LivenessWatch(60.0, 5.0, clock=clock)
    assert watch.silent(["a"]) == []
    clock.now += 1000  # idle for long: nobody waits on the engines
    assert watch.silent(["a"]) == []
    watch.begin("rollout step 3")
    assert watch.silent(["a"]) == []  # (the watcher looks every tick; an engine counts from its first sighting)
    clock.now += 59.75  # (steps that are exact in binary floating point)
    assert watch.silent(["a"]) == []
    clock.now += 0.25
    (found,) = watch.silent(["a"])
    assert (found.url, found.silent_s, found.during) == ("a", 60.0, "rollout step 3")
    clock.now += 100
    assert watch.silent(["a"]) == []  # each engine is named once
    watch.end("rollout step 3")
    assert not watch.in_flight


def test_an_answer_or_a_hold_starts_the_count_again(clock):
    watch = LivenessWatch(10.0, 1.0, clock=clock)
    watch.begin("rollout step 0")
    assert watch.silent(["a", "b"]) == []
    clock.now += 8
    watch.probed("a", answered=True)
    watch.probed("b", answered=False)  # an error or a probe past its timeout is no sign of life
    clock.now += 8
    assert [s.url for s in watch.silent(["a", "b"])] == ["b"]
    watch.hold()  # a weight push: answers may be late by design
    clock.now += 9
    assert watch.silent(["a"]) == []
    clock.now += 1
    assert [s.silent_s for s in watch.silent(["a"])] == [10.0]


def test_an_engine_that_joins_mid_step_counts_from_its_arrival_and_a_new_step_starts_afresh(clock):
    watch = LivenessWatch(10.0, 1.0, clock=clock)
    watch.begin("rollout step 1")
    assert watch.silent(["a"]) == []
    clock.now += 9
    assert watch.silent(["a", "new"]) == []
    clock.now += 1
    assert [s.url for s in watch.silent(["a", "new"])] == ["a"]
    clock.now += 9
    assert [s.url for s in watch.silent(["a", "new"])] == ["new"]
    watch.end("rollout step 1")
    watch.forget({"c"})  # both left the pool: an engine later at one of their addresses is watched afresh
    clock.now += 100
    watch.begin("rollout step 2")  # an old answer does not count, nor does time between the steps
    assert watch.silent(["a", "c"]) == []
    clock.now += 9.5
    assert watch.silent(["a", "c"]) == []
    clock.now += 0.5
    assert sorted(s.url for s in watch.silent(["a", "c"])) == ["a", "c"]


def test_spans_overlap_and_the_latest_is_named(clock):
    watch = LivenessWatch(5.0, 1.0, clock=clock)
    watch.begin("rollout step 4")
    watch.begin("evaluation at step 4")
    watch.end("rollout step 4")
    assert watch.in_flight and watch.silent(["a"]) == []
    clock.now += 5
    assert [s.during for s in watch.silent(["a"])] == ["evaluation at step 4"]


def test_probes_are_spaced_and_never_doubled(clock):
    watch = LivenessWatch(60.0, 5.0, clock=clock)
    assert watch.to_probe(["a", "b"]) == ["a", "b"]
    assert watch.to_probe(["a", "b"]) == []
    watch.probed("a", answered=True)
    clock.now += 4.9
    assert watch.to_probe(["a", "b"]) == []
    clock.now += 0.1
    assert watch.to_probe(["a", "b"]) == ["a"]  # b's probe is still out (a hung engine holds it until its timeout)
    with pytest.raises(ValueError):
        LivenessWatch(0.0, 1.0)


def test_the_flag_defaults_to_a_minute_and_zero_switches_it_off(tmp_path):
    from relax.config import parse_config
    from relax.config.errors import ConfigError

    base = ["--output-dir", str(tmp_path)]
    assert parse_config(base).engine_liveness_timeout == 60.0
    assert parse_config([*base, "--engine-liveness-timeout", "0"]).engine_liveness_timeout == 0.0
    with pytest.raises((SystemExit, ConfigError)):
        parse_config([*base, "--engine-liveness-timeout", "-1"])


# ---------------------------------------------------------------------------------------------- a real engine
TIMEOUT = 2.0


@pytest.fixture(scope="module")
def server():
    proc = EmbeddedServerProcess(str(shared_tiny_model()), server_args={"random_seed": 0, "dtype": "float32"})
    proc.start()
    try:
        yield proc.wait_healthy(120)
    finally:
        if proc.is_alive():
            proc._signal_group(signal.SIGCONT)  # a stopped server cannot act on SIGTERM
        proc.stop(timeout_s=5.0)


def watched_pool(url: str) -> EnginePool:
    pool = EnginePool(router=None)
    pool.engines[0] = Engine(0, url=url, state=ACTIVE)
    return pool


def generate(url: str, tokens: int) -> dict:
    payload = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": tokens, "temperature": 1.0,
                                                           "ignore_eos": True}}
    return requests.post(url + "/generate", json=payload, timeout=60).json()


def test_an_idle_or_busy_engine_is_never_named(server):
    watcher = EngineWatcher(watched_pool(server.url), TIMEOUT, interval_s=0.3, tick_s=0.1).start()
    try:
        # idle for twice the timeout (each probe a one-token generation), then generating for a while
        assert watcher.run(lambda: time.sleep(2 * TIMEOUT) or "idle", "rollout step 0") == "idle"
        def busy():
            t0, answers = time.monotonic(), []
            while time.monotonic() - t0 < 2 * TIMEOUT:
                answers.append(generate(server.url, 64))
            return answers

        out = watcher.run(busy, "rollout step 1")
        assert all(a["meta_info"]["completion_tokens"] == 64 for a in out), out[-1]
        assert watcher.found == [] and watcher.failure is None
        # the step's own error reaches the caller as it is
        with pytest.raises(ZeroDivisionError):
            watcher.run(lambda: 1 / 0, "rollout step 2")
    finally:
        watcher.stop()


def test_a_stopped_engine_is_named_and_the_step_waiting_on_it_ends(server):
    pool = watched_pool(server.url)
    watcher = EngineWatcher(pool, TIMEOUT, interval_s=0.3, tick_s=0.1).start()
    blocked = threading.Event()

    def step():  # requests one after the other: the one out when the engine stops is never answered
        threading.Timer(0.3, lambda: (server._signal_group(signal.SIGSTOP), blocked.set())).start()
        while watcher.failure is None:  # (once the server goes on at the end, this thread ends too)
            generate(server.url, 32)

    t0 = time.monotonic()
    try:
        with pytest.raises(EngineUnresponsive) as failure:
            watcher.run(step, "rollout step 7")
        waited = time.monotonic() - t0
    finally:
        server._signal_group(signal.SIGCONT)
        watcher.stop()
    assert blocked.is_set()
    text = str(failure.value)
    assert f"engine 0 ({server.url})" in text and "rollout step 7" in text and "--engine-liveness-timeout" in text
    assert "\n" not in text  # the console's one line
    # stopped 0.3 s in, its last answer at most one probe interval before: named after the timeout, within ~1 s
    assert TIMEOUT <= waited < 0.3 + TIMEOUT + 1.5, waited
    assert [e["kind"] for e in pool.events] == ["engine_unresponsive"]
    print(f"named {waited - 0.3:.2f} s after the stop (timeout {TIMEOUT:g} s)")


def test_with_fault_tolerance_the_engine_goes_the_health_monitors_way(server):
    pool = watched_pool(server.url)
    handed = []
    pool.on_failure = lambda e, reason: handed.append((e.url, reason))  # what HealthMonitor sets: handle
    watcher = EngineWatcher(pool, TIMEOUT, interval_s=0.3, tick_s=0.1).start()
    try:
        def step():
            server._signal_group(signal.SIGSTOP)
            deadline = time.monotonic() + 10
            while not handed and time.monotonic() < deadline:
                time.sleep(0.05)
            return "replaced meanwhile"

        assert watcher.run(step, "rollout step 2") == "replaced meanwhile"  # the step goes on
    finally:
        server._signal_group(signal.SIGCONT)
        watcher.stop()
    assert watcher.failure is None
    ((url, reason),) = handed
    assert url == server.url and "--engine-liveness-timeout" in reason
