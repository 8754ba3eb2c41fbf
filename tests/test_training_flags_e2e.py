"""End to end through the controller (real Ray, Megatron-core over gloo, an embedded engine behind the
sglang-router, TransferQueue), 1 actor rank and 1 engine:

1. --true-on-policy-mode + --keep-old-actor + --update-weights-interval 2 (+ --use-rollout-entropy,
   --recompute-loss-function) over 3 steps: at step 1 the engine still rolls out with the starting weights while
   the actor moved at step 0; the check (trainer log-probs under the kept rollout weights vs the engine's) passes
   at every step, which it only does when the old actor is the policy the engine used.
2. --advantage-estimator on_policy_distillation with a Megatron teacher (another random model): pure distillation.
"""

import math

import pytest
import ray

from conftest import assert_ray_released, shared_ray
from run_fixtures import read_records, train_argv

from relax.config import parse_config
from relax.config.support import unsupported_flags
from relax.core.controller import Controller
from relax.models.tiny import TinyArch, build_tiny_model_dir

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')


def _argv(model, data, out, *extra):
    return train_argv(model, data, out, *extra, actor_ranks=1)


def test_true_on_policy_with_kept_old_actor_and_delayed_weight_updates(assets):
    base, model, data = assets
    out = base / "on_policy"
    config = parse_config(_argv(model, data, out, "--num-rollout", "3", "--true-on-policy-mode", "--keep-old-actor",
                                "--update-weights-interval", "2", "--use-rollout-entropy", "--recompute-loss-function"))
    assert unsupported_flags(config) == []
    shared_ray()
    controller = Controller(config)
    try:
        controller.start()
        start = ray.get(controller.workers[0].weights_checksum.remote())
        controller.run()
        assert ray.get(controller.workers[0].weights_checksum.remote()) != start
    finally:
        controller.shutdown()
    records = read_records(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
        assert r["train/true_on_policy_max_abs_diff"] < 1e-4, r["train/true_on_policy_max_abs_diff"]
        assert r["train/entropy"] > 0
    assert "weights/version" in records[1] and "weights/version" not in records[0]
    print("true-on-policy max |trainer - engine| per step:",
          [r["train/true_on_policy_max_abs_diff"] for r in records])
    assert_ray_released()


def test_on_policy_distillation_with_a_megatron_teacher(assets):
    base, model, data = assets
    teacher = build_tiny_model_dir(base / "teacher", TinyArch(family="qwen2"), seed=1)
    out = base / "opd"
    config = parse_config(_argv(model, data, out, "--num-rollout", "2", "--advantage-estimator",
                                "on_policy_distillation", "--use-opd", "--opd-type", "megatron",
                                "--opd-teacher-load", str(teacher), "--opd-kl-coef", "1.0"))
    assert unsupported_flags(config) == []
    shared_ray()
    controller = Controller(config)
    try:
        controller.start()
        start = ray.get(controller.workers[0].weights_checksum.remote())
        teacher_sum = ray.get(controller.aux.teacher.workers[0].weights_checksum.remote())
        assert teacher_sum != pytest.approx(start, rel=1e-9)
        controller.run()
        assert ray.get(controller.workers[0].weights_checksum.remote()) != start
        assert ray.get(controller.aux.teacher.workers[0].weights_checksum.remote()) == teacher_sum
    finally:
        controller.shutdown()
    records = read_records(out)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 and "perf/teacher_logprob_time" in r
        assert abs(r["train/opd_reverse_kl"]) > 1e-6  # a different model: the only training signal
    assert_ray_released()
