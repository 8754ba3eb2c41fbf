"""End to end through the controller with a reference role: real Ray, Megatron-core over gloo (2 data-parallel
ranks for actor and reference), 1 embedded engine, TransferQueue.

1. GRPO + KL loss (low_var_kl) + TIS + --ref-update-interval 2 over 3 steps: the KL is 0 while the reference
   equals the actor (step 0), positive once the actor moved (step 1), and 0 again after the refresh (step 2).
2. REINFORCE++-baseline with --kl-coef reward shaping, dynamic batch size, and --ref-load from run 1's
   checkpoint (actor and reference both start from it).
"""

import pytest
import ray

from conftest import assert_ray_released, shared_ray
from run_fixtures import read_records, train_argv

from relax.config import parse_config
from relax.core.controller import Controller

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')

STATE: dict = {}
_argv = train_argv


def test_grpo_kl_loss_with_reference_refresh(assets):
    base, model, data = assets
    out = base / "run1"
    config = parse_config(_argv(model, data, out, "--num-rollout", "3", "--use-kl-loss", "--kl-loss-coef", "0.05",
                                "--kl-loss-type", "low_var_kl", "--ref-update-interval", "2", "--use-tis",
                                "--save-interval", "3"))
    shared_ray()
    controller = Controller(config)
    try:
        controller.start()
        ref = controller.aux.reference
        assert len(ref.workers) == 2
        start = ray.get(controller.workers[0].weights_checksum.remote())
        assert ray.get(ref.workers[0].weights_checksum.remote()) == pytest.approx(start, rel=1e-9)
        controller.run()
        STATE["actor_checksum"] = ray.get(controller.workers[0].weights_checksum.remote())
        assert STATE["actor_checksum"] != start
    finally:
        controller.shutdown()
    records = read_records(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    kl = [r["train/kl"] for r in records]
    for r in records:
        assert abs(r["train/loss"]) < 1e3 and r["train/grad_norm"] > 0
        assert "train/tis_weight_mean" in r and "perf/ref_logprob_time" in r
    assert abs(kl[0]) < 1e-6 and abs(kl[2]) < 1e-6, kl  # reference == actor at the start of steps 0 and 2
    assert kl[1] > 1e-5, kl  # the actor moved away from the (not yet refreshed) reference
    assert records[1]["perf/ref_update_time"] >= 0 and "perf/ref_update_time" not in records[0]
    ckpt = out / "checkpoints" / "iter_0000003"
    assert (ckpt / "reference" / "meta.json").is_file()
    STATE["ckpt_root"] = str(out / "checkpoints")


def test_reinforce_plus_plus_baseline_kl_reward_from_ref_load(assets):
    if "ckpt_root" not in STATE:
        pytest.skip("needs the checkpoint of test_grpo_kl_loss_with_reference_refresh")
    base, model, data = assets
    out = base / "run2"
    config = parse_config(_argv(model, data, out, "--num-rollout", "2", "--advantage-estimator",
                                "reinforce_plus_plus_baseline", "--normalize-advantages", "--kl-coef", "0.1",
                                "--kl-loss-type", "k3", "--ref-load", STATE["ckpt_root"],
                                "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"))
    shared_ray()
    controller = Controller(config)
    try:
        controller.start()
        start = ray.get(controller.workers[0].weights_checksum.remote())
        assert start == pytest.approx(STATE["actor_checksum"], rel=1e-9)  # the actor starts from --ref-load
        # on CPU the reference lives in the actor's rank processes (relax.roles.megatron_settings.reference_in_trainer)
        assert controller.aux.reference is None and controller.aux.reference_in_trainer
        ref_sum = ray.get(controller.workers[0].weights_checksum.remote("reference"))
        assert ref_sum == pytest.approx(STATE["actor_checksum"], rel=1e-9)
        controller.run()
        assert ray.get(controller.workers[0].weights_checksum.remote()) != start
        assert ray.get(controller.workers[0].weights_checksum.remote("reference")) == ref_sum
    finally:
        controller.shutdown()
    records = read_records(out)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert abs(r["train/loss"]) < 1e3 and r["train/grad_norm"] > 0
    assert abs(records[0]["train/kl"]) < 1e-6 and records[1]["train/kl"] > 1e-6, [r["train/kl"] for r in records]
    assert_ray_released()
