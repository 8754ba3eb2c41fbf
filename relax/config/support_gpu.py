"""Flags whose features exist only on GPUs: passed to Megatron's own implementation there, and refused on a
CPU-only run with the hardware reason (before Ray when the run is local, at the trainer's build otherwise).

They are built (not "not supported yet"): `relax.backends.megatron.optim` hands the optimizer ones to
Megatron's OptimizerConfig, `relax.backends.megatron.layer_options` the others to its TransformerConfig (and the
Transformer Engine layer spec). Each is a switch whose Megatron setting has the flag's name; the trainer receives the
ones that are on (`TrainerSettings.gpu_features`). A GPU feature whose value is more than on/off (fp8 recipes, ...)
needs a setting of its own in the trainer and stays "not supported yet" (relax.config.support_megatron)."""

from __future__ import annotations

import os
from typing import Any

from relax.config.errors import ConfigError

# dest -> what it does and why that needs a GPU
GPU_ONLY_REASONS: dict[str, str] = {
    "optimizer_cpu_offload": "moves the optimizer's state from GPU memory to the CPU (Megatron's hybrid-device "
                             "optimizer); on a CPU-only run it is in CPU memory already",
    "overlap_cpu_optimizer_d2h_h2d": "overlaps the GPU-CPU copies of --optimizer-cpu-offload on CUDA streams",
    "use_precision_aware_optimizer": "keeps the optimizer's state in lower precision with Transformer Engine's "
                                     "fused Adam (CUDA kernels)",
    "moe_grouped_gemm": "runs each rank's experts as one grouped GEMM of Transformer Engine (CUDA kernels)",
    "moe_permute_fusion": "permutes MoE tokens with Transformer Engine's fused kernels (CUDA)",
    "moe_router_fusion": "runs the MoE router's top-k and softmax as Transformer Engine's fused kernels (CUDA)",
    "use_torch_optimizer_for_cpu_offload": "with --optimizer-cpu-offload, steps the CPU copy of the state with "
                                           "torch's optimizer instead of the GPU one; it only matters with that "
                                           "GPU-to-CPU offload",
    "disable_bf16_reduced_precision_matmul": "switches off cuBLAS's reduced-precision reductions in bf16 matrix "
                                             "products (torch.backends.cuda.matmul); CPU matmuls have no such mode",
    # Relax's own GPU-only switch (relax.observability.profiling), not a Megatron setting: the trainer ranks wrap
    # torch.distributed's collectives when it is on
    "enable_cuda_memory_check": "logs free GPU memory (torch.cuda.mem_get_info) around every collective",
}
GPU_ONLY_FEATURES: frozenset[str] = frozenset(GPU_ONLY_REASONS)


def gpu_only_flags(config: Any) -> list[str]:
    """The GPU-only flags the user switched on, each with its reason."""
    names = config.meta.get("flag_names", {})
    return [f"{names.get(dest, '--' + dest.replace('_', '-'))} ({GPU_ONLY_REASONS[dest]})"
            for dest in sorted(GPU_ONLY_REASONS) if config.get(dest)]


def local_run_has_gpu() -> bool | None:
    """Whether a local run has a GPU (None: the run joins a Ray cluster at RAY_ADDRESS, checked by the ranks)."""
    if os.environ.get("RAY_ADDRESS"):
        return None
    import torch

    return torch.cuda.is_available()


def require_gpu_for(config: Any) -> None:
    """Refuse GPU-only flags on a local CPU-only run, naming each flag and why it needs a GPU."""
    flags = gpu_only_flags(config)
    if config.get("memory_snapshot_num_steps") and config.get("memory_recorder") == "torch":
        flags.append("--memory-snapshot-num-steps with --memory-recorder torch (records PyTorch's CUDA allocator; "
                     "--memory-recorder memray records host memory on CPU)")
    if flags and local_run_has_gpu() is False:
        raise ConfigError("needs a GPU, and this machine has none: " + "; ".join(flags)
                          + ". Remove these flags to run on the CPU")
