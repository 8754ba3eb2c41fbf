"""The launch scripts of examples/launch, unchanged in what they ask, run two steps on CPU scaled down:

* the colocated one (run-grpo-colocate.sh) by run-cpu.sh: the tiny model's flag file, tensor parallel 2 with
  sequence parallelism, full recompute, dynamic batching, colocated engines, its own checkpoint folder as --load
  and --save;
* the fully-async one (run-grpo-fully-async.sh) by run-cpu-async.sh: bounded staleness, each sample index
  trained once, with the script's KL loss, over-sampling filter, health checks and fault tolerance."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT

pytestmark = pytest.mark.e2e  # a whole run in its own process: Ray, trainer, reference, engines


def test_colocate_launch_script_runs_scaled_down(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "examples" / "launch" / "run-cpu.sh"), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert "not supported yet" not in console
    assert "--sglang-mem-fraction-static: no effect with the embedded engine" in console  # a GPU-only knob
    assert "trainer: 2 rank(s), data-parallel 1" in console  # tensor parallel 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and all(r["samples/trained"] == 8 for r in records)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    config = (tmp_path / "run" / "resolved_config.yaml").read_text()
    assert "sequence_parallel: true" in config and "recompute_granularity: full" in config


# examples/launch/run-cpu-async.sh: prompts x samples per prompt of each step, optimizer steps per rollout, and the
# script's own --max-staleness
ASYNC_BATCH, ASYNC_N, ASYNC_UPDATES, MAX_STALENESS = 2, 2, 2, 2


def test_fully_async_launch_script_runs_scaled_down(tmp_path):
    """The fully-async launch script (examples/launch/run-grpo-fully-async.sh), unchanged but for its two hooks
    (HF_MODE=raw, GPU_OPTIMIZER=0), runs two steps on CPU scaled down by examples/launch/run-cpu-async.sh: tensor
    parallel 2 with sequence parallelism, the KL loss against the reference, over-sampling with the dynamic-sampling
    filter, 2 optimizer steps per rollout, 4 storage units, health checks and engine fault tolerance on."""
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "examples" / "launch" / "run-cpu-async.sh"), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert "not supported yet" not in console
    # the script's SGLang server sizes: accepted, with one warning that names each
    warned = [line for line in console.splitlines() if "no effect with the embedded engine" in line]
    assert warned and all(flag in warned[0] for flag in (
        "--sglang-mem-fraction-static", "--sglang-enable-dp-attention", "--sglang-dp-size", "--sglang-ep-size",
        "--sglang-cuda-graph-bs", "--sglang-moe-a2a-backend")), warned
    assert "trainer: 2 rank(s), data-parallel 1" in console  # tensor parallel 2
    assert "reference: 2 rank(s)" in console  # the KL loss's reference, a role of its own in fully-async mode
    assert f"fully-async: rollout up to {MAX_STALENESS} step(s) ahead of training" in console
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    per_step = ASYNC_BATCH * ASYNC_N
    trained = []
    for r in records:
        assert r["samples/trained"] == per_step and r["train/num_updates"] == ASYNC_UPDATES, r
        # the policy version that trains step N (N updates made) minus each sample's weight version
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= MAX_STALENESS, r
        # each step trains a contiguous block of distinct sample indexes
        lo, hi = int(r["async/index_min"]), int(r["async/index_max"])
        assert r["async/num_indexes"] == per_step == hi - lo + 1, r
        trained += range(lo, hi + 1)
        assert r["rollout/zero_std_groups"] == 0, r  # the filter kept only groups whose rewards differ
        # the reference's pass and the KL loss term ran, and the TIS weights (--use-tis)
        assert {"perf/ref_logprob_time", "train/kl", "train/tis_ratio_mean"} <= set(r), sorted(r)
    assert records[0]["async/staleness_max"] == 0  # the first step's samples come from the initial weights
    assert sorted(trained) == list(range(2 * per_step))  # every index trained exactly once, none skipped
    totals = json.loads((run / "sample_accounting.json").read_text())["totals"]
    assert totals["trained"] == 2 * per_step and totals["filtered/check_reward_nonzero_std"] > 0  # the filter dropped
    assert totals["generated"] == totals["kept"] + totals["filtered"] + totals["returned_surplus"]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"  # the last step
    config = yaml.safe_load((run / "resolved_config.yaml").read_text())
    assert {k: config[k] for k in ("fully_async", "max_staleness", "num_steps_per_rollout", "num_data_storage_units",
                                   "over_sampling_batch_size", "tensor_model_parallel_size", "sequence_parallel",
                                   "megatron_to_hf_mode", "use_kl_loss", "use_health_check", "use_fault_tolerance",
                                   "optimizer_cpu_offload")} == {
        "fully_async": True, "max_staleness": MAX_STALENESS, "num_steps_per_rollout": ASYNC_UPDATES,
        "num_data_storage_units": 4, "over_sampling_batch_size": 3, "tensor_model_parallel_size": 2,
        "sequence_parallel": True, "megatron_to_hf_mode": "raw", "use_kl_loss": True, "use_health_check": True,
        "use_fault_tolerance": True, "optimizer_cpu_offload": False}
