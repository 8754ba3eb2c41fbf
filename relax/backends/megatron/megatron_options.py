"""Megatron flags passed to Megatron-core's config objects as they are (relax.config.megatron_options lists them):
the fields of each object, from `TrainerSettings.megatron_options`."""

from __future__ import annotations

import datetime
import importlib
import inspect
from typing import Any, Callable, Iterable, Optional

import torch
from megatron.core.config import set_experimental_flag
from megatron.core.jit import disable_jit_fuser
from megatron.core.parallel_state import update_pg_timeout
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.utils import check_param_hashes_across_dp_replicas

from relax.backends.megatron.optim import gather_params
from relax.config.megatron_options import (
    DDP,
    DDP_GPU,
    FLAG_NAMES,
    GPU_OPTIONS,
    MODEL,
    OPTIMIZER,
    OPTIMIZER_GPU,
    PIPELINE,
    PROCESS,
    PARALLEL,
    PARALLEL_GPU,
    SCHEDULER,
    TRANSFORMER,
    TRANSFORMER_GPU,
    TRANSFORMER_MOE,
)

# Megatron-LM's dtype names of the precision-aware optimizer's flags (its training script's map).
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
_DTYPE_FLAGS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
# Flags Megatron-LM parses as lists of one value per layer or per choice, that megatron-core 0.16 takes as a scalar.
_SCALAR_OF_LIST = ("moe_aux_loss_coeff", "moe_router_load_balancing_type", "cp_comm_type")


_RENAMED = {"decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
            "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage"}


def _scalar(dest: str, value: Any) -> Any:
    if dest in _SCALAR_OF_LIST and isinstance(value, (list, tuple)) and len(value) == 1:
        return value[0]
    return value


def _pick(options: Iterable[tuple[str, Any]], names: Iterable[str]) -> dict[str, Any]:
    names = set(names)
    return {dest: _scalar(dest, value) for dest, value in options if dest in names}


def require_cuda(options: Iterable[tuple[str, Any]]) -> None:
    """Refuse the GPU-only options on a trainer rank without CUDA (relax.config.support_gpu says why)."""
    gpu = sorted(dest for dest, _ in options if dest in GPU_OPTIONS)
    if gpu and not torch.cuda.is_available():
        names = [FLAG_NAMES.get(d, "--" + d.replace("_", "-")) for d in gpu]
        raise ValueError(f"{', '.join(names)} need(s) a GPU and this trainer rank "
                         "has none (relax.config.support_gpu says why); remove them to train on the CPU")


def transformer_fields(options: Iterable[tuple[str, Any]], is_moe: bool) -> dict[str, Any]:
    """TransformerConfig fields (`to_transformer_config(**fields)`)."""
    options = tuple(options)
    fields = _pick(options, TRANSFORMER | PIPELINE | TRANSFORMER_GPU | (TRANSFORMER_MOE if is_moe else frozenset()))
    if fields.pop("init_method_xavier_uniform", False):  # Megatron-LM: both init functions become Xavier's
        fields["init_method"] = fields["output_layer_init_method"] = torch.nn.init.xavier_uniform_
    for flag, field in _RENAMED.items():  # Megatron-LM's flag -> megatron-core's field
        if flag in fields:
            fields[field] = fields.pop(flag)
    if fields.get("cpu_offloading_num_layers"):
        fields["cpu_offloading"] = True  # Megatron-LM: --cpu-offloading-num-layers > 0 switches offloading on
    if "offload_modules" in fields:
        fields["offload_modules"] = list(fields["offload_modules"])
    return fields


def optimizer_fields(options: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """OptimizerConfig fields (`--no-weight-decay-cond-type apply_wd_to_qk_layernorm` is that field's other
    spelling in Megatron-LM)."""
    fields = _pick(options, OPTIMIZER | OPTIMIZER_GPU)
    for name in _DTYPE_FLAGS:
        if name in fields:
            fields[name] = _DTYPES[fields[name]]
    if dict(options).get("no_weight_decay_cond_type") == "apply_wd_to_qk_layernorm":
        fields["apply_wd_to_qk_layernorm"] = True
    return fields


def ddp_fields(options: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """DistributedDataParallelConfig fields (and `num_buckets`, which `wrap_ddp` turns into a bucket size)."""
    table = {**DDP, **DDP_GPU}
    fields = {table[dest]: value for dest, value in _pick(options, table).items()}
    if option(options, "data_parallel_random_init"):  # the ranks' own inits, then the first one's weights
        fields["broadcast_params"] = True
    if "grad_reduce_in_fp32" in fields:
        fields["grad_reduce_in_fp32"] = not fields["grad_reduce_in_fp32"]
    return fields


def scheduler_fields(options: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """The scheduler's settings by their flag names (`build_scheduler` turns them into Megatron's arguments)."""
    return _pick(options, SCHEDULER | {"global_batch_size"})


def parallel_fields(options: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """`initialize_model_parallel` arguments (and te_rng_tracker, an argument of the RNG seeding)."""
    fields = _pick(options, PARALLEL | PARALLEL_GPU)
    if fields.pop("use_tp_pp_dp_mapping", False):  # Megatron-LM's initialize: the other rank order
        fields["order"] = "tp-cp-ep-pp-dp"
    if "use_gloo_process_groups" in fields:
        fields["create_gloo_process_groups"] = fields.pop("use_gloo_process_groups")
    for name in ("high_priority_stream_groups", "hierarchical_context_parallel_sizes"):
        if name in fields:
            fields[name] = list(fields[name])
    return fields


def option(options: Iterable[tuple[str, Any]], dest: str, default: Optional[Any] = None) -> Any:
    return dict(options).get(dest, default)


def apply_process_options(options: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Apply the process-wide switches as Megatron-LM's initialisation does (--enable-experimental,
    --disable-jit-fuser); returns get_megatron_optimizer's own arguments (--dump-param-to-param-group-map, and
    --disable-gloo-process-groups, which Megatron-LM passes to it as well)."""
    fields = _pick(options, PROCESS)
    if fields.get("enable_experimental"):
        set_experimental_flag(True)
    if fields.get("disable_jit_fuser"):
        disable_jit_fuser()
    out = {k: v for k, v in fields.items() if k == "dump_param_to_param_group_map"}
    if option(options, "use_gloo_process_groups", True) is False:  # the optimizer's groups are the ones created
        out["use_gloo_process_groups"] = False
    return out


def local_layers(options: Iterable[tuple[str, Any]]) -> bool:
    """--spec local or --transformer-impl local: Megatron's own layers, never Transformer Engine's."""
    fields = _pick(options, MODEL)
    return tuple(fields.get("spec") or ()) == ("local",) or fields.get("transformer_impl") == "local"


def load_dotted(path: str) -> Callable:
    """The object at `package.module.name`."""
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"{path!r} is not a dotted path package.module.function")
    return getattr(importlib.import_module(module), name)


def model_builders(options: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """`build_gpt_model`'s `custom_spec` (--spec MODULE NAME, Megatron's import_module; a function is called for it)
    and `provider` (--custom-model-provider-path)."""
    fields = _pick(options, MODEL)
    out: dict[str, Any] = {}
    spec = tuple(fields.get("spec") or ())
    if spec and spec != ("local",):
        if len(spec) != 2:
            raise ValueError(f"--spec takes 'local' or a module and a name, got {' '.join(spec)}")
        found = import_module(spec)
        if found is None:
            raise ValueError(f"--spec {' '.join(spec)}: cannot import {spec[1]} from {spec[0]}")
        out["custom_spec"] = found if isinstance(found, ModuleSpec) else found()
    if fields.get("custom_model_provider_path"):
        out["provider"] = load_dotted(fields["custom_model_provider_path"])
    return out


def call_provider(provider: Callable, *, config: Any, arch: Any, pre_process: bool, post_process: bool,
                  vp_stage: Optional[int]) -> Any:
    """Call a --custom-model-provider-path function as Megatron-LM calls a model provider
    (`pre_process`, `post_process`, `vp_stage`), adding `config` (the trainer's TransformerConfig) and `arch`
    (relax.formats.model_arch.ModelArch) when it takes them: Relax has no Megatron-LM global arguments to read."""
    params = inspect.signature(provider).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {"pre_process": pre_process, "post_process": post_process}
    for name, value in (("vp_stage", vp_stage), ("config", config), ("arch", arch)):
        if takes_all or name in params:
            kwargs[name] = value
    return provider(**kwargs)


def after_optimizer_step(model: Any, iteration: int, options: Iterable[tuple[str, Any]], success: bool) -> None:
    """Megatron-LM's checks and settings after an optimizer step (`success`: the update was applied).

    --check-weight-hash-across-dp-replicas-interval N: every N optimizer steps, the weights of every data-parallel
    replica must hash the same (Megatron's check_param_hashes_across_dp_replicas, collective over the ranks; the
    overlapped param all-gather is finished first). --distributed-timeout-seconds-after-init S: once the first step
    applied in this process (a resumed run's too, as Megatron-LM's start_iteration + 1), every process group's timeout
    becomes S seconds (Megatron's update_pg_timeout; the first step, which builds the communicators and buckets, runs
    under --distributed-timeout-minutes)."""
    every = option(options, "check_weight_hash_across_dp_replicas_interval")
    if every and iteration % every == 0:
        gather_params(model)
        if not check_param_hashes_across_dp_replicas([model], cross_check=True):
            raise RuntimeError(f"the weights differ across data-parallel replicas after optimizer step {iteration}")
    seconds = option(options, "distributed_timeout_seconds_after_init")
    if success and seconds is not None and not getattr(model, "_timeout_after_init_set", False):
        update_pg_timeout(datetime.timedelta(seconds=seconds))
        model._timeout_after_init_set = True
