"""Profiles (--use-pytorch-profiler) and memory records (--memory-snapshot-num-steps) of the trainer ranks,
on CPU: torch.profiler's Chrome traces for the chosen targets, steps and ranks only; memray's record of the
first N steps; the CUDA-only recorders refused with why."""

import json
from pathlib import Path

import pytest
import torch

from relax.config import parse_config
from relax.observability.profiling import Profiling, install_cuda_memory_check


def _work():
    a = torch.randn(64, 64)
    return (a @ a).sum().item()


def _profiling(tmp_path, *extra, rank=0):
    config = parse_config(["--output-dir", str(tmp_path / "run"), "--memory-snapshot-dir", str(tmp_path / "mem"),
                           *extra])
    return Profiling.from_config(config, rank)


def test_profiles_only_the_chosen_targets_steps_and_ranks(tmp_path):
    flags = ("--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "3",
             "--profile-target", "train_actor", "--profile-with-flops")
    prof = _profiling(tmp_path, *flags)
    for step in range(4):
        with prof.section("train_actor", step):
            _work()
        with prof.section("train_log_probs", step):
            _work()
    out = tmp_path / "run" / "profiles"
    assert sorted(p.name for p in out.iterdir()) == ["train_actor-step1-rank0.json", "train_actor-step2-rank0.json"]
    trace = json.loads((out / "train_actor-step1-rank0.json").read_text())
    names = [e.get("name", "") for e in trace["traceEvents"]]
    assert any("mm" in n for n in names)  # the matmul was recorded
    other_rank = _profiling(tmp_path / "r1", *flags, rank=1)
    assert not other_rank.profiles("train_actor", 1)
    assert not _profiling(tmp_path / "off").profiles("train_overall", 10)  # without --use-pytorch-profiler


def test_memray_records_the_first_steps(tmp_path):
    pytest.importorskip("memray")
    prof = _profiling(tmp_path, "--memory-snapshot-num-steps", "2", "--memory-recorder", "memray")
    for _ in range(3):
        with prof.memory_step():
            _work()
    record = Path(tmp_path / "mem" / "memray-rank0.bin")
    assert record.stat().st_size > 0
    import memray

    with memray.FileReader(str(record)) as reader:
        assert reader.metadata.total_allocations > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_cuda_recorders_need_a_gpu(tmp_path):
    prof = _profiling(tmp_path, "--memory-snapshot-num-steps", "1")
    with pytest.raises(RuntimeError, match="needs a GPU; use --memory-recorder memray"):
        with prof.memory_step():
            pass
    with pytest.raises(RuntimeError, match="needs a GPU"):
        install_cuda_memory_check()


@pytest.mark.e2e
def test_a_run_writes_its_profiles_and_memory_record(tmp_path, tiny_model, prompt_file):
    from conftest import run_steps

    from relax.config.support import require_supported

    config = parse_config([
        "--hf-checkpoint", tiny_model, "--prompt-data", str(prompt_file), "--input-key", "input", "--label-key",
        "label", "--rm-type", "random", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "2", "--num-rollout", "1", "--output-dir", str(tmp_path / "run"),
        "--use-pytorch-profiler", "--profile-step-start", "0", "--profile-step-end", "1",
        "--profile-target", "train_overall", "train_actor", "--memory-snapshot-num-steps", "1",
        "--memory-recorder", "memray", "--memory-snapshot-dir", str(tmp_path / "mem")])
    require_supported(config)
    run_steps(config)
    profiles = sorted(p.name for p in (tmp_path / "run" / "profiles").iterdir())
    assert profiles == ["train_overall-step0-rank0.json"]  # train_actor: a labelled range inside it
    events = json.loads((tmp_path / "run" / "profiles" / profiles[0]).read_text())["traceEvents"]
    assert any(e.get("name") == "train_actor" for e in events)
    assert (tmp_path / "mem" / "memray-rank0.bin").stat().st_size > 0
