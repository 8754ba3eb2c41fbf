"""The data-parallel wrapper's flags (relax.config.megatron_options.DDP, PARALLEL, STEP): checked before Ray as
Megatron-LM checks them, passed to Megatron's DDP / optimizer / process groups, and on DP 2 over gloo giving the
losses, gradient norms and weights of the run without them where they only change communication; the NCCL ones are
refused on a CPU-only run with the hardware reason."""

import logging

import pytest
import torch

from relax.backends.megatron.testing import build_random_tiny_model, hf_arch, run_ranks, toy_pg_loss, toy_samples
from relax.config import ConfigError, parse_config
from relax.config.support import unsupported_flags
from relax.config.support_gpu import require_gpu_for
from relax.roles.megatron_settings import trainer_settings

torch.set_num_threads(1)

STEPS = 2
BASE = dict(lr=1e-3, micro_batch_size=1, seed=11, clip_grad=1.0, use_distributed_optimizer=True)
# several buckets, so that the overlapped all-gather has a next bucket to start (--no-align-param-gather)
OVERLAP = (("overlap_grad_reduce", True), ("overlap_param_gather", True), ("ddp_bucket_size", 20000))
LAYOUTS = {
    "distopt": (),
    "overlap": OVERLAP,
    "overlap_unaligned": OVERLAP + (("align_param_gather", False),),
    # flags that change no update: one run for the three (each checked on its own below)
    "instances_checks": (("num_distributed_optimizer_instances", 2), ("check_for_large_grads", True),
                         ("distributed_timeout_seconds_after_init", 77)),
}


def _options(tmp_path, *flags):
    config = parse_config(["--output-dir", str(tmp_path), *flags])
    assert unsupported_flags(config) == []
    return dict(trainer_settings(config).megatron_options)


def test_the_flags_travel_and_megatron_lms_checks_stop_before_ray(tmp_path):
    assert _options(tmp_path, "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                    "--no-align-param-gather", "--check-for-large-grads", "--num-distributed-optimizer-instances", "1",
                    "--distributed-timeout-seconds-after-init", "60") == {
        "overlap_grad_reduce": True, "overlap_param_gather": True, "align_param_gather": False,
        "check_for_large_grads": True, "distributed_timeout_seconds_after_init": 60}
    options = _options(tmp_path, "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
                       "--resource", '{"actor": [1, 4], "rollout": [1, 1]}', "--micro-batch-size", "1")
    from relax.backends.megatron.megatron_options import ddp_fields, optimizer_fields, parallel_fields

    overlap = _options(tmp_path, "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
    assert ddp_fields(overlap.items())["overlap_param_gather"] and optimizer_fields(overlap.items()) == {
        "overlap_param_gather": True}  # Megatron-LM sets both configs' field
    assert ddp_fields(options.items())["num_distributed_optimizer_instances"] == 2
    assert parallel_fields(options.items())["num_distributed_optimizer_instances"] == 2
    for flags, message in [
        (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"),
        (["--overlap-param-gather", "--use-distributed-optimizer"], "--overlap-param-gather needs --overlap-grad-reduce"),
        (["--no-align-param-gather"], "without --overlap-param-gather it does nothing"),
        (["--num-distributed-optimizer-instances", "2"], "add --use-distributed-optimizer"),
        (["--num-distributed-optimizer-instances", "3", "--use-distributed-optimizer", "--resource",
          '{"actor": [1, 4], "rollout": [1, 1]}', "--micro-batch-size", "1"], "must divide the actor's data-parallel size 4"),
        (["--distributed-timeout-seconds-after-init", "0"], "positive number of seconds"),
        (["--disable-symmetric-registration"], "add --use-nccl-ub"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config(["--output-dir", str(tmp_path), *flags])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
@pytest.mark.parametrize("flags,fields,reason", [
    (["--use-nccl-ub"], {"nccl_ub": True}, "NCCL user buffers"),
    (["--disable-symmetric-registration", "--use-nccl-ub"], {"disable_symmetric_registration": True, "nccl_ub": True},
     "symmetric \\(window\\) NCCL"),
    (["--create-all-gather-group"], {"create_all_gather_group": True}, "a second NCCL communicator"),
])
def test_nccl_flags_are_gpu_only(tmp_path, monkeypatch, flags, fields, reason):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = parse_config(["--output-dir", str(tmp_path), *flags])
    assert unsupported_flags(config) == []
    with pytest.raises(ConfigError, match=f"needs a GPU, and this machine has none: {flags[0]} .*{reason}"):
        require_gpu_for(config)
    from relax.backends.megatron.megatron_options import ddp_fields, parallel_fields, require_cuda

    options = trainer_settings(config).megatron_options
    with pytest.raises(ValueError, match=f"{flags[0]}.* need"):
        require_cuda(options)
    # on a GPU they reach Megatron's DDP config / initialize_model_parallel
    assert {**ddp_fields(options), **parallel_fields(options)} == fields


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _layout_run(rank, path, samples, name):
    from megatron.core import parallel_state as ps
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings

    trainer = MegatronTrainer(hf_arch(path), TrainerSettings(**BASE, megatron_options=LAYOUTS[name]))
    trainer.load_hf(path)
    # the next bucket norm checked counts as "unexpectedly large" (as after 100 small ones)
    machine = get_rerun_state_machine()
    machine.large_value_counts["grads"], machine.max_values["grads"] = 100, 1e-12
    lines = _Lines()
    logging.getLogger("megatron.core.rerun_state_machine").addHandler(lines)
    half = samples[rank * 2:(rank + 1) * 2]
    out = {"metrics": [], "weights": [], "deferred": [], "bucket_groups": len(trainer.model.bucket_groups)}
    for _ in range(STEPS):
        metrics = trainer.train_step(half, toy_pg_loss)
        out["metrics"].append((metrics["loss"], metrics["grad_norm"]))
        # with --overlap-param-gather the step leaves the other rank's shards to the next forward pass
        out["deferred"].append(any(not g.param_gather_dispatched for g in trainer.model.bucket_groups))
        out["weights"].append(dict(trainer.export_hf_weights()))
    logging.getLogger("megatron.core.rerun_state_machine").removeHandler(lines)
    out["large_grad_warnings"] = sum("found unexpected large grads" in line for line in lines.lines)
    out["timeout"] = ps.get_data_parallel_group()._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    out["ddp"] = {k: getattr(trainer.model.ddp_config, k) for k in (
        "overlap_param_gather", "align_param_gather", "check_for_large_grads", "num_distributed_optimizer_instances")}
    out["optimizer_overlap"] = trainer.optimizer.config.overlap_param_gather
    out["instances"] = ps.get_intra_distributed_optimizer_instance_group().size()
    return out


def _worker(rank, world, path, samples):
    from megatron.core import parallel_state as ps

    results = {}
    for name in LAYOUTS:
        results[name] = _layout_run(rank, path, samples, name)
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = build_random_tiny_model(tmp_path_factory.mktemp("ddp") / "qwen2", "qwen2", seed=21)
    return run_ranks(_worker, 2, str(path), toy_samples(4, seed=9), timeout=300)


def _same_run(a, b):
    for (loss_a, norm_a), (loss_b, norm_b) in zip(a["metrics"], b["metrics"]):
        assert loss_a == pytest.approx(loss_b, rel=1e-5) and norm_a == pytest.approx(norm_b, rel=1e-5)
    for step_a, step_b in zip(a["weights"], b["weights"]):
        assert step_a.keys() == step_b.keys()
        for name in step_a:
            torch.testing.assert_close(step_a[name], step_b[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["overlap", "overlap_unaligned"])
def test_overlapped_param_gather_trains_as_the_plain_distributed_optimizer(ranks, name):
    """--overlap-param-gather: each step leaves the all-gather to the next forward pass, and the weights exported
    right after the step (before any forward pass) are still the whole updated ones, on both ranks."""
    for rank in ranks:
        assert rank[name]["ddp"]["overlap_param_gather"] and rank[name]["optimizer_overlap"]
        assert rank[name]["ddp"]["align_param_gather"] is (name == "overlap")
        assert rank[name]["bucket_groups"] > 1 and all(rank[name]["deferred"])
        assert not any(rank["distopt"]["deferred"])  # without the flag the step gathers itself
        _same_run(rank[name], rank["distopt"])
    _same_run(ranks[0][name], ranks[1][name])


def test_two_distributed_optimizer_instances_train_as_one(ranks):
    """--num-distributed-optimizer-instances 2 on DP 2: each instance shards over one rank, the gradients are
    all-reduced across the instances; the updates are the DP-2 distributed optimizer's."""
    for rank in ranks:
        assert rank["instances_checks"]["ddp"]["num_distributed_optimizer_instances"] == 2
        assert rank["instances_checks"]["instances"] == 1 and rank["distopt"]["instances"] == 2
        _same_run(rank["instances_checks"], rank["distopt"])


def test_large_grads_are_reported_and_the_timeout_changes_after_the_first_step(ranks):
    for rank in ranks:
        run = rank["instances_checks"]
        assert run["ddp"]["check_for_large_grads"] and run["large_grad_warnings"] > 0
        assert rank["distopt"]["large_grad_warnings"] == 0  # the same primed state, no check without the flag
        assert run["timeout"] == 77 and rank["distopt"]["timeout"] != 77
        _same_run(run, rank["distopt"])  # a warning only: the steps are the same
