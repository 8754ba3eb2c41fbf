"""GPU-only Megatron switches (optimizer offload and overlap, the precision-aware optimizer, Transformer Engine's
MoE kernels): --dry-run names each with why it needs a GPU, a run on this CPU-only machine stops before Ray with
that reason, a trainer rank without CUDA refuses them at its build, and the trainer receives them."""

import pytest
import torch
from conftest import relax_cli

from relax.backends.megatron.testing import build_random_tiny_model, ensure_single_process, hf_trainer
from relax.config import parse_config
from relax.config.support import unsupported_flags
from relax.roles.megatron_settings import trainer_settings

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")

FLAGS = ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
         "--moe-grouped-gemm", "--moe-permute-fusion"]


def test_dry_run_names_the_hardware_reason_and_a_run_stops_before_ray(tmp_path):
    proc = relax_cli("--dry-run", "--output-dir", str(tmp_path), *FLAGS)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "every flag you set is supported"
    need = next(line for line in lines if line.startswith("needs a GPU"))
    assert all(flag in need for flag in FLAGS) and "Transformer Engine" in need and "CUDA" in need
    proc = relax_cli("--output-dir", str(tmp_path), "--optimizer-cpu-offload")
    assert proc.returncode == 2
    assert "needs a GPU, and this machine has none: --optimizer-cpu-offload (moves the optimizer's state" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "logs").exists()  # nothing started


def test_the_trainer_gets_them_and_refuses_them_without_cuda(tmp_path):
    config = parse_config(["--output-dir", str(tmp_path), *FLAGS])
    assert unsupported_flags(config) == []
    assert set(trainer_settings(config).gpu_features) == {f[2:].replace("-", "_") for f in FLAGS}
    ensure_single_process()
    path = build_random_tiny_model(tmp_path / "m", "qwen2", seed=3)
    with pytest.raises(ValueError, match="--optimizer-cpu-offload need"):
        hf_trainer(path, gpu_features=("optimizer_cpu_offload",))
