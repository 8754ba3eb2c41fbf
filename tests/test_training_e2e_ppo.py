"""End to end through the controller with a critic role (PPO) and a teacher role (on-policy distillation): real
Ray, Megatron-core over gloo (2 data-parallel ranks per role), 1 embedded engine, TransferQueue.

1. PPO over 2 steps with --num-critic-only-steps 1 and --critic-save: no actor update in step 0, one in step 1;
   actor and critic weights change; critic metrics are finite; the critic checkpoint is written.
2. PPO + OPD (--opd-type megatron) with the teacher from run 1's actor checkpoint and --critic-load from run 1's
   critic save root: the critic starts from run 1's final critic, the teacher differs from the student.
"""

import math

import pytest
import ray

from conftest import assert_ray_released, shared_ray
from run_fixtures import read_records, train_argv

from relax.config import parse_config
from relax.core.controller import Controller

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')

STATE: dict = {}


def _argv(model, data, out, *extra):
    return train_argv(model, data, out, "--advantage-estimator", "ppo", *extra)


def _checksums(controller):
    return (ray.get(controller.workers[0].weights_checksum.remote()),
            ray.get(controller.aux.critic.workers[0].weights_checksum.remote()))


def test_ppo_with_critic(assets):
    base, model, data = assets
    out = base / "run1"
    config = parse_config(_argv(model, data, out, "--num-rollout", "2", "--num-critic-only-steps", "1",
                                "--gamma", "0.99", "--lambd", "0.95", "--value-clip", "0.5", "--critic-lr", "5e-3",
                                "--critic-save", str(base / "critic_ckpt"), "--save-interval", "2"))
    shared_ray()
    controller = Controller(config)
    try:
        controller.start()
        assert len(controller.aux.critic.workers) == 2 and controller.aux.reference is None
        start_actor, start_critic = _checksums(controller)
        controller.run()
        end_actor, end_critic = _checksums(controller)
        STATE["critic"] = end_critic
    finally:
        controller.shutdown()
    assert end_actor != start_actor and end_critic != start_critic
    records = read_records(out)
    assert [r["step"] for r in records] == [0, 1]
    assert [r["train/num_updates"] for r in records] == [0, 1]
    for r in records:
        for key in ("critic/value_loss", "critic/values_mean", "critic/clip_fraction", "critic/grad_norm",
                    "critic/returns_mean", "train/advantages_mean"):
            assert math.isfinite(r[key]), (key, r)
        assert r["critic/grad_norm"] > 0
        assert "critic_returns" not in r
    assert math.isfinite(records[1]["train/loss"]) and records[1]["train/grad_norm"] > 0
    # the critic's first update uses --critic-lr on the actor's schedule (the actor's first update is in step 1)
    assert records[0]["critic/lr"] / 5e-3 == pytest.approx(records[1]["train/lr"] / 1e-2, rel=1e-6)
    assert (base / "critic_ckpt" / "iter_0000002" / "critic" / "meta.json").is_file()
    assert (base / "critic_ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (out / "checkpoints" / "iter_0000002" / "actor" / "meta.json").is_file()
    STATE["ckpt_root"] = str(out / "checkpoints")
    STATE["critic_root"] = str(base / "critic_ckpt")


def test_ppo_with_opd_teacher_and_critic_load(assets):
    if "ckpt_root" not in STATE:
        pytest.skip("needs the checkpoints of test_ppo_with_critic")
    base, model, data = assets
    out = base / "run2"
    config = parse_config(_argv(model, data, out, "--num-rollout", "2", "--critic-load", STATE["critic_root"],
                                "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", STATE["ckpt_root"],
                                "--opd-teacher-ckpt-step", "2", "--opd-kl-coef", "0.5"))
    shared_ray()
    controller = Controller(config)
    try:
        controller.start()
        start_actor, start_critic = _checksums(controller)
        assert start_critic == pytest.approx(STATE["critic"], rel=1e-9)
        teacher = ray.get(controller.aux.teacher.workers[0].weights_checksum.remote())
        assert teacher != pytest.approx(start_actor, rel=1e-9)
        controller.run()
        end_actor, end_critic = _checksums(controller)
        assert end_actor != start_actor and end_critic != start_critic
        assert ray.get(controller.aux.teacher.workers[0].weights_checksum.remote()) == teacher
    finally:
        controller.shutdown()
    records = read_records(out)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
        assert math.isfinite(r["critic/value_loss"]) and "perf/teacher_logprob_time" in r
        assert abs(r["train/opd_reverse_kl"]) > 1e-6  # the teacher (run 1's actor) differs from the student
    assert_ray_released()
