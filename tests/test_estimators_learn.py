"""Each main advantage estimator raises the reward on the embedded model (real Ray, Megatron over gloo, an
embedded engine behind sglang-router, TransferQueue): the format-warm-started tiny model answers a digit
uniformly; every prompt's label is 7, so the reward starts near chance (0.1) and a working estimator, loss
and weight sync must move it up within 8 steps of 64 samples. A KL loss to the warm start keeps the answer
format (without it the policy drifts off the format at this learning rate), and 4 warm-up iterations keep the
first update small (the head-only warm start collapses in one full-rate update: relax.models.embedded). ppo
trains its critic alongside. rloo runs fully-async (--fully-async --max-staleness 1): the rollout of step N+1
runs while step N trains, so one estimator proves that asynchronous training (samples of the policy one update
behind, every sample index trained once) raises the reward too, with no run of its own in the suite.
Runs are deterministic (per-sample sampling seeds), so the thresholds do not depend on machine load."""

import json
import statistics

import pytest
from conftest import run_steps

from relax.config import parse_config
from relax.models.embedded import build_embedded_assets

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("learn")
    build_embedded_assets(str(base / "model"), str(base / "orig.jsonl"), seed=0)
    rows = [json.loads(line) for line in (base / "orig.jsonl").read_text().splitlines()]
    (base / "train.jsonl").write_text("".join(json.dumps({**r, "label": "7"}) + "\n" for r in rows))
    return base


ASYNC = {"rloo": ["--fully-async", "--max-staleness", "1"]}  # the estimators that run fully-async


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "rloo", "ppo"])
def test_estimator_raises_the_reward(assets, estimator):
    config = parse_config([
        "--hf-checkpoint", str(assets / "model"), "--prompt-data", str(assets / "train.jsonl"),
        "--input-key", "input", "--label-key", "label", "--apply-chat-template", "--rm-type", "exact_match",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--num-rollout", "8",
        "--num-steps-per-rollout", "2", "--rollout-max-response-len", "4", "--lr", "1e-3",
        "--lr-decay-style", "constant", "--lr-warmup-iters", "4", "--micro-batch-size", "8", "--rollout-shuffle",
        "--use-kl-loss", "--kl-loss-coef", "0.05", "--kl-loss-type", "low_var_kl",
        "--advantage-estimator", estimator, "--resource", '{"actor": [1, 1], "rollout": [1, 1]}',
        "--distributed-backend", "gloo", "--output-dir", str(assets / estimator), *ASYNC.get(estimator, [])])
    records = run_steps(config)
    rewards = [r["rollout/reward_mean"] for r in records]
    assert len(rewards) == 8
    start, end = statistics.fmean(rewards[:2]), statistics.fmean(rewards[-3:])
    assert start < 0.2, rewards
    assert end > start + 0.12, f"{estimator}: reward did not rise: {rewards}"
    if estimator in ASYNC:
        _assert_ran_async(records)


def _assert_ran_async(records):
    """The run really was asynchronous: some step trained samples of the policy one update behind (never more),
    and consecutive steps tile the sample indexes (each trained once, none skipped), as
    tests/test_fully_async_e2e.py checks."""
    assert all(0 <= r["async/staleness_max"] <= 1 for r in records), records
    assert max(r["async/staleness_max"] for r in records) == 1, [r["async/staleness_max"] for r in records]
    expected = 0
    for r in records:
        assert r["async/index_min"] == expected, r
        assert r["async/index_max"] - r["async/index_min"] + 1 == r["async/num_indexes"] == r["data/step_samples"] == 64
        expected = int(r["async/index_max"]) + 1
    assert expected == 8 * 64
