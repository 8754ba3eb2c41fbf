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
from relax.config.megatron_options import GPU_OPTIONS, same_value

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
_TE = "Transformer Engine's CUDA kernels"
_FP8 = "a setting of fp8 training, which runs on " + _TE + " (Hopper or newer GPUs)"
_FP4 = "a setting of fp4 training, which runs on " + _TE + " (Blackwell GPUs)"
_OFFLOAD = "moves activations from GPU memory to the CPU on CUDA streams (Megatron's activation offloading)"
_PRECISION_AWARE = ("a state dtype of --use-precision-aware-optimizer, Transformer Engine's fused Adam (CUDA "
                    "kernels)")
# Megatron-core settings passed as values (relax.config.megatron_options, `TrainerSettings.megatron_options`), not
# through `TrainerSettings.gpu_features`: each reaches its Megatron config object on a GPU
# (relax.backends.megatron.megatron_options) and is refused on a CPU-only run.
GPU_ONLY_OPTION_REASONS: dict[str, str] = {
    "fp8": "fp8 training with " + _TE + " (Hopper or newer GPUs)",
    "fp8_recipe": _FP8, "fp8_margin": _FP8, "fp8_interval": _FP8, "fp8_amax_history_len": _FP8,
    "fp8_amax_compute_algo": _FP8, "fp8_wgrad": _FP8, "fp8_param_gather": _FP8, "keep_fp8_transpose_cache": _FP8,
    "first_last_layers_bf16": _FP8 + " or fp4", "num_layers_at_start_in_bf16": _FP8 + " or fp4",
    "num_layers_at_end_in_bf16": _FP8 + " or fp4", "moe_router_padding_for_fp8": _FP8,
    "moe_router_padding_for_quantization": _FP8 + " or fp4", "reuse_grad_buf_for_mxfp8_param_ag": _FP8 + " (MXFP8)",
    "fp4": "fp4 training with " + _TE + " (Blackwell GPUs)", "fp4_recipe": _FP4, "fp4_param": _FP4,
    # Python import paths of quantizer factories, loaded by megatron-core itself for a custom recipe
    "fp8_quantizer_factory": _FP8 + " (the quantizers of --fp8-recipe custom)",
    "fp4_quantizer_factory": _FP4 + " (the quantizers of a custom fp4 recipe)",
    "use_te_activation_func": "runs the MLP's activation as Transformer Engine's fused kernel (CUDA)",
    "batch_invariant_mode": "swaps in batch-invariant CUDA (Triton) kernels for matmuls and reductions",
    "symmetric_ar_type": "all-reduces through NCCL / CUDA symmetric memory (multimem) on GPUs",
    "cpu_offloading_num_layers": _OFFLOAD, "fine_grained_activation_offloading": _OFFLOAD,
    "offload_modules": _OFFLOAD, "min_offloaded_tensor_size": _OFFLOAD,
    "cp_comm_type": ("chooses the key/value exchange of Transformer Engine's context-parallel attention (CUDA); "
                     "the CPU attention always all-gathers (--allgather-cp)"),
    "hierarchical_context_parallel_sizes": "the groups of --cp-comm-type a2a+p2p, Transformer Engine's attention (CUDA)",
    "main_grads_dtype": _PRECISION_AWARE, "main_params_dtype": _PRECISION_AWARE, "exp_avg_dtype": _PRECISION_AWARE,
    "exp_avg_sq_dtype": _PRECISION_AWARE,
    "optimizer_offload_fraction": "the share of the optimizer state --optimizer-cpu-offload moves off the GPU",
    "pin_cpu_grads": "pinned host memory for the GPU-to-CPU copies of --optimizer-cpu-offload",
    "pin_cpu_params": "pinned host memory for the GPU-to-CPU copies of --optimizer-cpu-offload",
    "use_sharp": "NCCL's SHARP in-network reductions (InfiniBand switches)",
    "sharp_enabled_group": "NCCL's SHARP in-network reductions (InfiniBand switches)",
    "high_priority_stream_groups": "NCCL communicators on high-priority CUDA streams",
    "nccl_communicator_config_path": "a YAML of NCCL communicator settings (NCCL is the GPU collective library)",
    "te_rng_tracker": "Transformer Engine's CUDA RNG tracker",
    "nccl_ub": ("allocates the data-parallel param and grad buffers from NCCL's memory pool and registers them as "
                "NCCL user buffers (torch.cuda.MemPool, NCCL: GPU only)"),
    "disable_symmetric_registration": ("chooses local instead of symmetric (window) NCCL registration of "
                                       "--use-nccl-ub's user buffers (NCCL: GPU only)"),
    "create_all_gather_group": ("a second NCCL communicator over the data-parallel ranks, so that all-gathers get "
                                "their own NCCL progress engine instead of queueing behind reduce-scatters (GPU "
                                "only; gloo runs each collective in order on its own threads)"),
    "fp32_residual_connection": ("keeps the residual stream in fp32 under bf16/fp16; Transformer Engine's layers (CUDA) "
                                 "cast it for their matmuls, megatron-core's local layers (the CPU's) do not"),
    "use_kitchen_attention": "NVIDIA Kitchen's quantized attention kernels (CUDA)",
    "kitchen_attention_backend": "chooses the backend of NVIDIA Kitchen's quantized attention (CUDA)",
}
assert set(GPU_ONLY_OPTION_REASONS) == GPU_OPTIONS, sorted(GPU_OPTIONS ^ set(GPU_ONLY_OPTION_REASONS))
# Megatron-LM's NCCL flight recorder: torch.distributed's NCCL process groups record their recent collectives and
# dump them (on a timeout, ...) when these environment variables are set before the groups are created. The trainer
# ranks get them in their environment (`flight_recorder_env`); gloo, the CPU backend, records nothing.
_FLIGHT_RECORDER = "a setting of NCCL's flight recorder (torch.distributed's NCCL process groups, GPU only)"
FLIGHT_RECORDER_ENV: dict[str, str] = {  # dest -> the environment variable, as Megatron-LM sets them
    "flight_recorder_trace_buffer_size": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "flight_recorder_dump_on_timeout": "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "flight_recorder_include_stack_trace": "TORCH_INCLUDE_STACK_TRACE",
    "flight_recorder_include_only_active": "TORCH_INCLUDE_ONLY_ACTIVE",
    "flight_recorder_extra_dump_on_exec": "TORCH_NCCL_EXTRA_DUMP_ON_EXEC",
}
_DUMP_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
GPU_ONLY_ENV_REASONS: dict[str, str] = {
    "flight_recorder_dump_path": "switches on NCCL's flight recorder and names where its dumps go (torch.distributed's "
                                 "NCCL process groups, GPU only)",
    **{dest: _FLIGHT_RECORDER for dest in FLIGHT_RECORDER_ENV},
}
_ALL_REASONS = {**GPU_ONLY_REASONS, **GPU_ONLY_OPTION_REASONS, **GPU_ONLY_ENV_REASONS}
GPU_ONLY_FEATURES: frozenset[str] = frozenset(_ALL_REASONS)


def flight_recorder_env(config: Any, environ: Any = None) -> dict[str, str]:
    """The trainer ranks' flight-recorder environment, as Megatron-LM sets it: only once a dump path is known
    (--flight-recorder-dump-path, or TORCH_FR_DUMP_TEMP_FILE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE already set); a
    directory gets the per-rank prefix `<dir>/_dump_`; a variable already set (in this environment or
    --train-env-vars) keeps its value."""
    environ = os.environ if environ is None else environ
    given = {**environ, **(config.get("train_env_vars") or {})}
    path = next((given[v] for v in _DUMP_VARS if given.get(v)), None) or config.get("flight_recorder_dump_path")
    if not path:
        return {}
    prefix = os.path.join(path, "_dump_") if os.path.isdir(path) else str(path)
    wanted = {var: prefix for var in _DUMP_VARS}
    for dest, var in FLIGHT_RECORDER_ENV.items():
        value = config.get(dest)
        wanted[var] = str(int(value)) if isinstance(value, bool) else str(value)
    return {var: value for var, value in wanted.items() if var not in given}


def gpu_only_flags(config: Any) -> list[str]:
    """The GPU-only flags the user switched on or set to a value other than the default, each with its reason."""
    names = config.meta.get("flag_names", {})
    defaults = config.meta.get("defaults", {})
    return [f"{names.get(dest, '--' + dest.replace('_', '-'))} ({_ALL_REASONS[dest]})"
            for dest in sorted(_ALL_REASONS)
            if (not same_value(config.get(dest), defaults[dest]) if dest in defaults else config.get(dest))]


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
