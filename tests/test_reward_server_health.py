"""The reward server's watch (relax.rollout.rewards.server_health), without Ray: the decision logic with a scripted
probe, then the real stack (probe, RewardRunner, remote_rm) against a reward server process that is SIGSTOPped,
resumed or SIGKILLed, through the test-only fault injection (relax.health_faults, role=reward)."""

import asyncio
import json
import signal
import threading
import time
from dataclasses import dataclass, field

import psutil
import pytest

import reward_server_proc

from relax.health_faults import ENV, RankFault, listener_pid
from relax.rollout.rewards import RewardRunner
from relax.rollout.rewards.server_health import (MAX_HOLDS, RewardServerLost, RewardServerWatch, health_url, probe,
                                                 watch_from_args)


class Script:
    """A probe whose answer the test sets."""

    def __init__(self):
        self.ok, self.why, self.calls = True, "", 0

    def __call__(self, url, timeout_s):
        self.calls += 1
        return self.ok, self.why

    def down(self, why="dead: connection refused"):
        self.ok, self.why = False, why

    def up(self):
        self.ok, self.why = True, ""


def scripted(tmp_path, bound_s=5.0):
    script = Script()
    watch = RewardServerWatch("http://rm:1/score", interval_s=0.05, timeout_s=0.05, bound_s=bound_s,
                              log_path=str(tmp_path / "reward_server.jsonl"), probe_fn=script)
    return script, watch.start()


def events(tmp_path):
    return [json.loads(x)["event"] for x in (tmp_path / "reward_server.jsonl").read_text().splitlines()]


def test_health_url():
    assert health_url("http://h:8000/score") == "http://h:8000/health"
    assert health_url("https://h/v1/reward?x=1") == "https://h/health"


def test_request_in_flight_is_held_and_sent_again(tmp_path):
    """The server goes down under a request: it is cancelled, held, and sent again once the server answers."""
    script, watch = scripted(tmp_path)
    sent = []

    async def request():
        sent.append(time.monotonic())
        if len(sent) == 1:
            await asyncio.sleep(60)  # the hung server's reply never comes
        return 1.0

    async def main():
        call = asyncio.ensure_future(watch.call(request))
        await asyncio.sleep(0.2)
        script.down("hung: no reply")
        await asyncio.sleep(0.5)
        assert len(sent) == 1 and not call.done()  # held, not sent again while down
        script.up()
        return await asyncio.wait_for(call, 5)

    try:
        assert asyncio.run(main()) == 1.0
    finally:
        watch.close()
    assert len(sent) == 2
    assert events(tmp_path) == ["down", "up"]
    assert [e["held"] for e in watch.events if e["event"] == "up"] == [1]


def test_failed_request_is_a_probe(tmp_path):
    """A request that fails while the server answers failed on its own (its policy applies); one that fails while
    the server does not answer is held and sent again."""
    script, watch = scripted(tmp_path)
    watch.interval_s = 3600.0  # only the failed request probes

    async def own_failure():
        raise ValueError("HTTP 400: bad request")

    async def main():
        with pytest.raises(ValueError, match="HTTP 400"):
            await watch.call(own_failure)
        tries = []

        async def dead_then_back():
            tries.append(1)
            if len(tries) == 1:
                script.down()
                threading.Timer(0.3, script.up).start()
                raise ConnectionError("connection refused")
            return 0.5

        return await asyncio.wait_for(watch.call(dead_then_back), 5)

    time.sleep(0.1)  # the thread's first probe
    try:
        watch.interval_s = 0.05
        assert asyncio.run(main()) == 0.5
    finally:
        watch.close()
    assert events(tmp_path) == ["down", "up"]


def test_a_request_is_held_through_at_most_max_holds_outages(tmp_path):
    """A server that fails every request and is down each time (flapping): the request is sent MAX_HOLDS + 1
    times, then its failure follows --reward-error-policy instead of holding the step for ever."""
    script, watch = scripted(tmp_path)
    tries = []

    async def flapping():
        tries.append(1)
        script.down()
        threading.Timer(0.1, script.up).start()
        raise ConnectionError("connection reset")

    try:
        with pytest.raises(ConnectionError):
            asyncio.run(asyncio.wait_for(watch.call(flapping), 10))
    finally:
        watch.close()
    assert len(tries) == MAX_HOLDS + 1


def test_server_not_back_within_the_bound(tmp_path):
    script, watch = scripted(tmp_path, bound_s=0.5)
    script.down("dead: connection refused")
    time.sleep(0.2)

    async def request():
        return 1.0

    async def main():
        return await asyncio.gather(*(watch.call(request) for _ in range(3)), return_exceptions=True)

    t0 = time.monotonic()
    try:
        out = asyncio.run(main())
    finally:
        watch.close()
    assert 0.4 < time.monotonic() - t0 < 3.0
    assert all(isinstance(e, RewardServerLost) for e in out), out
    text = str(out[0])
    assert "\n" not in text and len(text) < 400  # the run's one failure line
    assert text.startswith("reward server http://rm:1/score does not answer /health for ")
    assert "(dead: connection refused)" in text and "--reward-timeout 0.5" in text
    assert events(tmp_path) == ["down", "lost"]


def test_watch_only_for_remote_rm_with_fault_tolerance(tmp_path):
    @dataclass
    class Args:
        rm_url: str = "http://127.0.0.1:9/score"
        rm_type: str = "remote_rm"
        use_fault_tolerance: bool = True
        rollout_health_check_interval: float = 30.0
        rollout_health_check_timeout: float = 1.0
        reward_timeout: float = 60.0
        output_dir: str = str(tmp_path)
        meta: dict = field(default_factory=dict)

    assert watch_from_args(Args(use_fault_tolerance=False)) is None
    assert watch_from_args(Args(rm_type="math")) is None
    watch = watch_from_args(Args(rm_url="http://127.0.0.1:9/x"))
    try:
        assert watch is not None and watch.bound_s == 60.0 and watch.timeout_s == 1.0
        assert watch_from_args(Args(rm_url="http://127.0.0.1:9/x", rm_type="boxed_remote_rm")) is watch  # per process
    finally:
        watch.close()


def test_env_fault_is_armed_on_the_watch(tmp_path, monkeypatch):
    """relax-train's rollout manager reads RELAX_TEST_TRAINER_FAULT (role=reward) and the run's attempt."""
    monkeypatch.setenv(ENV, "hang:role=reward:step=2:resume=3:times=2")

    class Args:
        rm_url, rm_type, use_fault_tolerance, reward_timeout = "http://127.0.0.1:9/env", "remote_rm", True, 30.0
        rollout_health_check_interval, rollout_health_check_timeout = 30.0, 1.0
        output_dir, meta = str(tmp_path), {"health_attempt": 1}

    watch = watch_from_args(Args())
    try:
        assert [(f.kind, f.step, f.resume_s, f.times) for f in watch.faults] == [("hang", 2, 3.0, 2)]
        assert watch.attempt == 1
    finally:
        watch.close()


# ---------------------------------------------------------------------------- a real reward server process
@pytest.fixture
def server(tmp_path):
    proc, url, hits = reward_server_proc.start(tmp_path)
    yield proc, url, hits
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.wait(10)


@dataclass
class Sample:
    response: str
    label: str
    metadata: dict = field(default_factory=dict)
    rollout_step: int = 0


def _runner(url, watch):
    # on_error="zero": without the watch a failed request would be trained on as 0.0
    return RewardRunner("remote_rm", on_error="zero", timeout_s=10.0, server_watch=watch,
                        rm_options={"rm_url": url, "max_retries": 0, "timeout": 10.0})


def test_probe_tells_hung_from_dead(server):
    proc, url, _ = server
    assert probe(url, 1.0) == (True, "")
    assert listener_pid(url) == proc.pid
    proc.send_signal(signal.SIGSTOP)
    ok, why = probe(url, 0.3)
    assert not ok and why.startswith("hung: ")
    proc.send_signal(signal.SIGCONT)
    assert probe(url, 2.0) == (True, "")
    proc.kill()
    proc.wait(10)
    assert probe(url, 1.0) == (False, "dead: connection refused")


def test_hung_server_resumed_every_sample_scored_once(server, tmp_path):
    """SIGSTOP at step 1's first request (the injected fault, resumed after 2.5 s): found within the probe's
    interval and timeout, named, and every request of the step answered by the server, none scored 0.0."""
    proc, url, hits = server
    watch = RewardServerWatch(url, interval_s=0.1, timeout_s=1.0, bound_s=10.0,
                              log_path=str(tmp_path / "reward_server.jsonl")).start()
    watch.faults = [RankFault.parse("hang:role=reward:step=1:resume=2.5")]
    samples = [Sample(f"answer {i % 3}", "1", rollout_step=1) for i in range(12)]
    t0 = time.monotonic()
    with _runner(url, watch) as runner:
        result = runner.score(samples, assign=True)
    elapsed = time.monotonic() - t0
    watch.close()
    assert result.num_errors == 0 and not any("reward_error" in s.metadata for s in samples)
    assert [s.reward for s in samples] == [1.0 if i % 3 == 1 else 0.25 for i in range(12)]
    kinds = [e["event"] for e in watch.events]
    assert kinds == ["fault_injected", "down", "up"], watch.events
    fired, down, up = watch.events
    detect_s = down["time"] - fired["time"]
    assert detect_s < 0.1 + 1.0 + 1.0, detect_s  # interval + timeout (+ a loaded machine's slack)
    assert "hung: " in down["why"] and up["held"] >= 1
    answered = len((hits).read_text().splitlines())
    assert answered >= 12  # every sample's request; the held ones were answered again after the resume
    print(f"hang: detected {detect_s:.2f} s after SIGSTOP, back {up['down_s']:.2f} s after detection, "
          f"{up['held']} request(s) held, step scored in {elapsed:.2f} s")
    assert psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED


def test_killed_server_fails_the_step_whatever_the_policy(server, tmp_path):
    proc, url, _ = server
    watch = RewardServerWatch(url, interval_s=0.1, timeout_s=1.0, bound_s=1.0).start()
    watch.faults = [RankFault.parse("kill:role=reward:step=0")]
    samples = [Sample("x", "1") for _ in range(4)]
    t0 = time.monotonic()
    with _runner(url, watch) as runner:
        with pytest.raises(RewardServerLost, match=r"\(dead: connection (refused|reset)\).*--reward-timeout 1\b"):
            runner.score(samples, assign=True)
    watch.close()
    assert time.monotonic() - t0 < 5.0
    assert not any("reward_error" in s.metadata for s in samples)  # nothing scored 0.0
    assert [e["event"] for e in watch.events] == ["fault_injected", "down", "lost"]
    assert proc.wait(5) == -signal.SIGKILL
