"""How RewardRunner calls built-in synchronous rewards (`registry.call_mode`): cheap ones inline on the event
loop, the others in one thread hop per group with a per-sample deadline; failures counted as before."""

import threading
import time
from dataclasses import dataclass, field

import pytest

from relax.rollout.rewards import RewardError, RewardRunner, register_reward, score_samples
from relax.rollout.rewards import registry
from relax.rollout.rewards.registry import BATCHED, INLINE, PER_CALL, call_mode


@dataclass
class Sample:
    response: str
    label: object = None
    metadata: dict = field(default_factory=dict)


def test_call_modes_of_builtins_and_user_rewards():
    assert call_mode("exact_match") == INLINE and call_mode("boxed_exact_match") == INLINE
    assert call_mode("math") == BATCHED and call_mode("boxed_math") == BATCHED
    assert call_mode("remote_rm") == PER_CALL

    @register_reward("test_inline_user_rm", overwrite=True)
    def _user(response, label, metadata):
        return 1.0

    assert call_mode("test_inline_user_rm") == PER_CALL


def test_overwritten_builtin_is_called_per_sample(monkeypatch):
    monkeypatch.setitem(registry._FACTORIES, "f1", registry._FACTORIES["f1"])
    monkeypatch.setitem(registry._MODES, "f1", INLINE)
    register_reward("f1", lambda r, l, m: 2.0, overwrite=True)
    assert call_mode("f1") == PER_CALL
    assert score_samples([Sample("x", "y")], "f1").rewards == [2.0]


def test_inline_scores_on_the_event_loop_thread(monkeypatch):
    threads = set()

    def spy(response, label, metadata):
        threads.add(threading.get_ident())
        return 1.0 if response == label else 0.0

    monkeypatch.setitem(registry._FACTORIES, "exact_match", lambda **_: spy)
    samples = [[Sample(str(i % 2), "1") for i in range(4)] for _ in range(3)]
    with RewardRunner("exact_match") as runner:
        res = runner.score(samples, assign=True)
    assert res.rewards == [0.0, 1.0] * 6 and res.stats["num_calls"] == 12
    assert threads == {threading.get_ident()}  # asyncio.run runs the loop on this thread
    assert [s.reward for g in samples for s in g] == [0.0, 1.0] * 6


def test_batched_is_one_hop_per_group(monkeypatch):
    seen = []

    def spy(response, label, metadata):
        seen.append((threading.get_ident(), metadata["g"]))
        return float(response)

    monkeypatch.setitem(registry._FACTORIES, "math", lambda **_: spy)
    groups = [[Sample(str(g * 10 + i), metadata={"g": g}) for i in range(5)] for g in range(3)]
    res = score_samples(groups, "math")
    assert res.rewards == [float(g * 10 + i) for g in range(3) for i in range(5)]
    by_group = {}
    for tid, g in seen:
        by_group.setdefault(g, set()).add(tid)
    assert all(len(t) == 1 for t in by_group.values()) and threading.get_ident() not in set().union(*by_group.values())


def test_mixed_modes_keep_sample_order():
    group = [Sample("\\boxed{3}", "3", {"rm_type": "math"}), Sample("a", "a"), Sample("7", "8", {"rm_type": "math"}),
             Sample("b", "a")]
    res = score_samples([group], "exact_match")
    assert res.rewards == [1.0, 1.0, 0.0, 0.0]


def test_failures_are_counted_and_named_as_before(monkeypatch):
    def boom(response, label, metadata):
        if response == "boom":
            raise RuntimeError("kaboom")
        return {"reward": 1.0} if response == "dict" else ("nan" if response == "nan" else 1.0)

    for rm in ("exact_match", "math"):
        monkeypatch.setitem(registry._FACTORIES, rm, lambda **_: boom)
        samples = [Sample("x"), Sample("boom"), Sample("dict"), Sample("nan")]
        res = score_samples(samples, rm, on_error="zero")
        assert res.rewards == [1.0, 0.0, 1.0, 0.0] and res.num_errors == 2 and res.error_indices == [1, 3]
        assert samples[1].metadata["reward_error"] == "RuntimeError: kaboom"
        assert samples[3].metadata["reward_error"].startswith("ValueError: reward is not finite")
        with pytest.raises(RewardError, match=rf"sample 1 \(reward {rm}\): RuntimeError: kaboom") as info:
            score_samples([Sample("x"), Sample("boom")], rm)
        assert isinstance(info.value.__cause__, RuntimeError)


def test_unknown_per_sample_type_still_fails_per_sample():
    res = score_samples([Sample("a", "a"), Sample("a", "a", {"rm_type": "nope"})], "exact_match", on_error="zero")
    assert res.rewards == [1.0, 0.0] and res.error_indices == [1]


def test_batched_sample_past_its_deadline_fails_and_the_rest_are_scored(monkeypatch):
    calls = []

    def slow(response, label, metadata):
        calls.append(response)
        if response == "slow":
            time.sleep(1.0)
        return 1.0

    monkeypatch.setitem(registry._FACTORIES, "math", lambda **_: slow)
    group = [Sample("a"), Sample("slow"), Sample("b"), Sample("c")]
    start = time.monotonic()
    res = RewardRunner("math", timeout_s=0.3, on_error="zero").score([group])
    assert time.monotonic() - start < 0.9  # did not wait for the slow call
    assert res.rewards == [1.0, 0.0, 1.0, 1.0] and res.error_indices == [1]
    assert "did not return within 0.3 s (--reward-timeout)" in group[1].metadata["reward_error"]
    time.sleep(0.9)  # the abandoned call finishes; the hop started nothing after it
    assert sorted(calls) == ["a", "b", "c", "slow"]
    with pytest.raises(RewardError, match=r"sample 1 .*did not return within 0.3 s"):
        RewardRunner("math", timeout_s=0.3).score([[Sample("a"), Sample("slow")]])
