"""RewardRunner: concurrency, failure policy, custom (sync/async) and group rewards, reward_key."""

import asyncio
import textwrap
import threading
import time
from dataclasses import dataclass, field

import pytest

from relax.rollout.rewards import (
    CustomReward,
    RewardError,
    RewardRunner,
    load_custom_reward,
    register_reward,
    score_samples,
)


@dataclass
class Sample:
    response: str
    label: object = None
    metadata: dict = field(default_factory=dict)


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    """An importable module of user reward functions: relax_test_custom_rm.<fn>."""
    (tmp_path / "relax_test_custom_rm.py").write_text(textwrap.dedent(
        """
        import asyncio

        def sync_rm(args, sample):
            return 1.0 if sample.response == sample.label else 0.0

        async def async_rm(args, sample):
            await asyncio.sleep(0)
            return {"score": 2.0 if sample.response == sample.label else -1.0, "note": "x"}

        def group_rm(args, samples):
            # rank within the group: best = longest response
            order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
            out = [0.0] * len(samples)
            for rank, i in enumerate(order):
                out[i] = float(rank)
            return out

        async def async_group_rm(args, samples):
            return [float(args.bonus) for _ in samples]

        def bad_group_rm(args, samples):
            return [1.0]

        def raising_rm(args, sample):
            if sample.response == "boom":
                raise RuntimeError("kaboom")
            return 1.0

        NOT_CALLABLE = 3
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "relax_test_custom_rm"


def test_builtin_scoring_flat_and_dict_samples():
    samples = [Sample("a", "a"), {"response": "b", "label": "a"}, Sample(" c ", ["c"])]
    res = score_samples(samples, "exact_match")
    assert res.rewards == [1.0, 0.0, 1.0]
    assert res.num_errors == 0 and res.stats["num_samples"] == 3


def test_per_sample_rm_type_override():
    samples = [Sample("\\boxed{0.5}", "1/2"), Sample("\\boxed{0.5}", "1/2", {"rm_type": "exact_match"})]
    assert score_samples(samples, "math").rewards == [1.0, 0.0]


def test_unknown_rm_type_fails_at_construction():
    with pytest.raises(ValueError, match="unknown reward type"):
        RewardRunner("not_a_type")


def test_sync_rewards_run_concurrently_in_thread_pool():
    barrier = threading.Barrier(4, timeout=5)

    @register_reward("test_barrier_rm", overwrite=True)
    def _barrier(response, label, metadata):
        barrier.wait()  # deadlocks unless 4 calls run at the same time
        return 1.0

    with RewardRunner("test_barrier_rm", max_workers=4) as runner:
        assert runner.score([Sample(str(i)) for i in range(4)]).rewards == [1.0] * 4


def test_async_builtin_rewards_are_awaited_concurrently():
    @register_reward("test_async_sleep_rm", overwrite=True)
    async def _sleepy(response, label, metadata):
        await asyncio.sleep(0.2)
        return 0.5

    t0 = time.perf_counter()
    res = score_samples([Sample(str(i)) for i in range(20)], "test_async_sleep_rm")
    assert res.rewards == [0.5] * 20
    assert time.perf_counter() - t0 < 2.0


def test_reward_key_and_dict_rewards():
    @register_reward("test_dict_rm", overwrite=True)
    def _d(response, label, metadata):
        return {"score": 3.0, "acc": 1.0}

    assert score_samples([Sample("x")], "test_dict_rm").rewards == [3.0]  # default: "score"
    res = score_samples([Sample("x")], "test_dict_rm", reward_key="acc")
    assert res.rewards == [1.0] and res.raw == [{"score": 3.0, "acc": 1.0}]
    with pytest.raises(RewardError, match="sample 0.*no key 'missing'"):
        score_samples([Sample("x")], "test_dict_rm", reward_key="missing")


def test_fail_policy_names_sample_index_and_exception():
    @register_reward("test_flaky_rm", overwrite=True)
    def _flaky(response, label, metadata):
        if response == "boom":
            raise ZeroDivisionError("bad sample")
        return 1.0

    samples = [Sample("ok"), Sample("ok"), Sample("boom")]
    with pytest.raises(RewardError, match=r"sample 2 \(reward test_flaky_rm\): ZeroDivisionError: bad sample") as ei:
        score_samples(samples, "test_flaky_rm", on_error="fail")
    assert isinstance(ei.value.__cause__, ZeroDivisionError)


def test_zero_policy_scores_zero_marks_and_counts():
    @register_reward("test_flaky_rm2", overwrite=True)
    def _flaky(response, label, metadata):
        if response == "boom":
            raise ValueError("nope")
        if response == "nan":
            return float("nan")
        return 1.0

    samples = [Sample("ok"), Sample("boom"), Sample("nan"), {"response": "boom", "metadata": None}]
    with RewardRunner("test_flaky_rm2", on_error="zero") as runner:
        res = runner.score(samples)
        assert res.rewards == [1.0, 0.0, 0.0, 0.0]
        assert res.num_errors == 3 and res.error_indices == [1, 2, 3]
        assert res.stats["num_errors"] == 3
        assert samples[1].metadata["reward_error"] == "ValueError: nope"
        assert "not finite" in samples[2].metadata["reward_error"]
        assert samples[3]["metadata"]["reward_error"] == "ValueError: nope"
        assert "reward_error" not in samples[0].metadata
        runner.score([Sample("boom")])
        assert runner.stats()["num_errors"] == 4 and runner.stats()["num_batches"] == 2


def test_invalid_policy_rejected():
    with pytest.raises(ValueError, match="on_error"):
        RewardRunner("exact_match", on_error="ignore")


def test_load_custom_reward_sync_and_async(custom_module):
    sync = load_custom_reward(f"{custom_module}.sync_rm")
    asyn = load_custom_reward(f"{custom_module}:async_rm")
    assert isinstance(sync, CustomReward) and not sync.is_async and asyn.is_async
    s = Sample("a", "a")
    assert sync(None, s) == 1.0
    assert asyn(None, s) == {"score": 2.0, "note": "x"}  # blocking form runs the coroutine
    assert asyncio.run(sync.acall(None, s)) == 1.0
    assert asyncio.run(asyn.acall(None, s))["score"] == 2.0


def test_load_custom_reward_errors_name_the_path(custom_module):
    with pytest.raises(ImportError, match="no_such_module"):
        load_custom_reward("no_such_module.fn")
    with pytest.raises(ImportError, match=f"{custom_module}.*has no attribute 'missing'"):
        load_custom_reward(f"{custom_module}.missing")
    with pytest.raises(TypeError, match="not callable"):
        load_custom_reward(f"{custom_module}.NOT_CALLABLE")
    with pytest.raises(ValueError):
        load_custom_reward("justaname")


def test_runner_with_custom_sync_and_async(custom_module):
    samples = [Sample("a", "a"), Sample("b", "a")]
    assert score_samples(samples, custom_rm_path=f"{custom_module}.sync_rm").rewards == [1.0, 0.0]
    res = score_samples(samples, custom_rm_path=f"{custom_module}.async_rm", reward_key="score")
    assert res.rewards == [2.0, -1.0]


def test_custom_fn_object_and_errors(custom_module):
    with pytest.raises(RewardError, match=r"sample 1 \(reward custom .*raising_rm\): RuntimeError: kaboom"):
        score_samples([Sample("x"), Sample("boom")], custom_rm_path=f"{custom_module}.raising_rm")
    res = score_samples([Sample("x"), Sample("boom")], custom_fn=lambda args, s: len(s.response))
    assert res.rewards == [1.0, 4.0]


def test_group_rm_one_call_per_group(custom_module):
    groups = [[Sample("aaa"), Sample("a"), Sample("aa")], [Sample("b"), Sample("bbbb")]]
    with RewardRunner(custom_rm_path=f"{custom_module}.group_rm", group_rm=True) as runner:
        res = runner.score(groups)
    assert res.rewards == [2.0, 0.0, 1.0, 0.0, 1.0]
    assert res.stats["num_calls"] == 2 and res.stats["num_groups"] == 2

    class Args:
        bonus = 5

    flat = [Sample(str(i)) for i in range(6)]
    res = score_samples(flat, custom_rm_path=f"{custom_module}.async_group_rm", group_rm=True, args=Args(), group_size=3)
    assert res.rewards == [5.0] * 6 and res.stats["num_calls"] == 2
    with pytest.raises(ValueError, match="groups of 4"):
        score_samples(flat, custom_rm_path=f"{custom_module}.async_group_rm", group_rm=True, group_size=4)


def test_group_rm_failure_policy(custom_module):
    groups = [[Sample("a"), Sample("b")], [Sample("c")]]
    with pytest.raises(RewardError, match=r"group 0 \(samples 0\.\.1\).*returned 1 rewards for a group of 2"):
        score_samples(groups, custom_rm_path=f"{custom_module}.bad_group_rm", group_rm=True)
    res = score_samples(groups, custom_rm_path=f"{custom_module}.bad_group_rm", group_rm=True, on_error="zero")
    assert res.rewards == [0.0, 0.0, 1.0] and res.error_indices == [0, 1]
    assert "returned 1 rewards" in groups[0][1].metadata["reward_error"]


def test_score_inside_running_loop_requires_ascore():
    async def main():
        with RewardRunner("exact_match") as runner:
            with pytest.raises(RuntimeError, match="ascore"):
                runner.score([Sample("a", "a")])
            return (await runner.ascore([Sample("a", "a")])).rewards

    assert asyncio.run(main()) == [1.0]


def test_from_args(custom_module):
    class Args:
        rm_type = "math"
        custom_rm_path = None
        group_rm = False
        reward_key = None
        reward_error_policy = "zero"

    with RewardRunner.from_args(Args()) as runner:
        assert runner.on_error == "zero"
        assert runner.score([Sample("\\boxed{2}", "2")]).rewards == [1.0]


def test_relax_sample_response_text_and_assign():
    from relax.data.sample import Sample as RelaxSample

    samples = [RelaxSample(response_text="\\boxed{2}", label="2"), RelaxSample(response_text="1", label="2")]
    with RewardRunner("math") as runner:
        res = runner.score(samples, assign=True)
    assert res.rewards == [1.0, 0.0]
    assert [s.reward for s in samples] == [1.0, 0.0] and samples[0].raw_reward == 1.0
    d = {"response": "a", "label": "a"}
    score_samples([d], "exact_match", assign=True)
    assert d["reward"] == 1.0


def test_a_reward_that_never_returns_fails_by_its_deadline():
    async def never(args, sample):
        await asyncio.Event().wait()

    samples = [Sample("a", "a"), Sample("b", "a")]
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"sample 0 .*did not return within 0.3 s \(--reward-timeout\)"):
        RewardRunner(custom_fn=never, timeout_s=0.3).score(samples)
    assert time.monotonic() - start < 5
    result = RewardRunner(custom_fn=never, timeout_s=0.3, on_error="zero").score(samples)
    assert result.rewards == [0.0, 0.0] and result.num_errors == 2
