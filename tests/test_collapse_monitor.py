"""Collapse detection of the per-step metrics (issue 18): a warning names the step when every group has zero
reward variance or the entropy falls below the floor; a streak warns once (then every `repeat_every` steps)."""

import io
import logging
from types import SimpleNamespace

from relax.observability.metrics import CollapseMonitor, MetricsWriter
from relax.rollout.step_logs import group_variance_metrics, step_log_metrics


def _monitor(stream):
    log = logging.getLogger("test.collapse")
    log.handlers[:] = [logging.StreamHandler(stream)]
    log.setLevel(logging.INFO)
    log.propagate = False
    return CollapseMonitor(entropy_floor=0.05, repeat_every=10, log=log)


def _step(reward_mean, reward_std, entropy, **extra):
    return {"rollout/reward_mean": reward_mean, "rollout/reward_std": reward_std, "rollout/num_samples": 512.0,
            "rollout/num_groups": 32.0, "train/entropy": entropy, **extra}


def test_collapse_onto_the_stop_token_warns_naming_the_step():
    # The metrics of issue 18's seed 4321 from step 5: every answer the bare stop token, reward exactly 0.
    stream = io.StringIO()
    mon = _monitor(stream)
    assert mon.check(4, _step(0.12, 0.32, 0.9)) == []
    msgs = mon.check(5, _step(0.0, 0.0, 0.04))
    assert len(msgs) == 2 and all(m.startswith("step 5: ") for m in msgs)
    assert "zero reward variance" in msgs[0] and "collapsed" in msgs[0]
    assert "below the floor" in msgs[1]
    assert mon.check(6, _step(0.0, 0.0, 0.04)) == []  # the same streak: no repeat every step
    assert len(mon.check(15, _step(0.0, 0.0, 0.04))) == 2  # ...but a reminder every 10 steps
    assert mon.check(16, _step(0.2, 0.4, 0.5)) == []
    assert "began at step 5 ended" in stream.getvalue()


def test_group_fraction_is_preferred_and_singletons_never_warn():
    mon = _monitor(io.StringIO())
    # Mixed all-right and all-wrong groups: reward_std > 0 but every group is constant.
    assert "zero reward variance" in mon.check(3, _step(0.5, 0.5, 0.6, **{"rollout/zero_std_group_fraction": 1.0}))[0]
    assert mon.check(4, _step(0.5, 0.5, 0.6, **{"rollout/zero_std_group_fraction": 0.9})) == []
    one_sample = {"rollout/reward_mean": 0.0, "rollout/reward_std": 0.0, "rollout/num_samples": 8.0,
                  "rollout/num_groups": 8.0}
    assert mon.check(5, one_sample) == []
    assert "task is solved" in mon.check(6, _step(1.0, 0.0, 0.3))[0]
    assert mon.check(7, _step(0.99, 0.1, 0.03)) == []  # converged: low entropy at a high reward is fine


def test_group_variance_metrics():
    s = lambda g, r: SimpleNamespace(group_index=g, reward=r)  # noqa: E731
    samples = [s(0, 0.0), s(0, 1.0), s(1, 0.0), s(1, 0.0), s(2, 1.0), s(2, 1.0), s(3, 0.0)]
    out = group_variance_metrics(samples)
    assert out == {"rollout/zero_std_groups": 2.0, "rollout/zero_std_group_fraction": 2 / 3}
    assert group_variance_metrics([s(0, 1.0)]) == {}
    no_logs = SimpleNamespace(log_multi_turn=False, log_correct_samples=False, log_reward_category=None)
    assert step_log_metrics(no_logs, 0, samples) == out


def test_metrics_writer_runs_the_monitor(tmp_path, caplog):
    writer = MetricsWriter(str(tmp_path), stream=io.StringIO())
    with caplog.at_level(logging.WARNING, logger="relax.collapse"):
        writer.log(0, _step(0.1, 0.3, 1.2))
        writer.log(1, _step(0.0, 0.0, 0.02))
    writer.close()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["step 1", "step 1"]
