"""Megatron DDP wrapper, optimizer and learning-rate scheduler for one model chunk."""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["wrap_ddp", "gather_params", "build_optimizer", "build_scheduler"]

# Megatron's own GPU optimizer features, switched on by their flags (relax.config.support_gpu)
OPTIMIZER_GPU_FEATURES = ("optimizer_cpu_offload", "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer",
                          "use_torch_optimizer_for_cpu_offload")


def wrap_ddp(model: torch.nn.Module, transformer_config, *, use_distributed_optimizer: bool, align_grad_reduce: bool = True,
             num_buckets: Optional[int] = None, broadcast_params: bool = False, **ddp_overrides: Any):
    """Wrap a GPTModel in Megatron's DDP (contiguous grad buffers, `main_grad`).

    Also points the config at `finalize_model_grads`, which all-reduces
    gradients over data-parallel ranks (and embeddings over pipeline ends).
    `ddp_overrides`: DistributedDataParallelConfig fields (relax.backends.megatron.megatron_options.ddp_fields).
    With `overlap_grad_reduce`, Megatron-LM's training script's hooks are set as it sets them: the schedules run
    every micro-batch but the last under `no_sync` (each bucket's reduce starts as the last backward pass fills
    it) and, with `align_grad_reduce` (--no-align-grad-reduce turns it off), pipeline schedules start each
    stage's reduce together.
    `num_buckets` (--ddp-num-buckets) sets the bucket size to the model's parameter count over it, as Megatron-LM.
    `broadcast_params` (--data-parallel-random-init): every data-parallel rank takes the first one's weights, as
    Megatron-LM does after initialising each with its own seed.
    `align_param_gather` is on unless --no-align-param-gather, as Megatron-LM's default; with
    `overlap_param_gather` the schedules get DDP's start_param_sync as Megatron-LM sets it (only the interleaved
    schedule calls it, which Relax does not run), and the weights are complete only after `gather_params`.
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    if num_buckets is not None:
        if ddp_overrides.get("bucket_size") is not None or num_buckets <= 0:
            raise ValueError("--ddp-num-buckets takes a positive count, and not with --ddp-bucket-size")
        ddp_overrides["bucket_size"] = sum(p.numel() for p in model.parameters()) // num_buckets
    ddp_config = DistributedDataParallelConfig(**{
        "grad_reduce_in_fp32": True,
        "overlap_grad_reduce": False,
        "use_distributed_optimizer": use_distributed_optimizer,
        "check_for_nan_in_grad": False,
        "align_param_gather": True,
        **ddp_overrides,
    })
    wrapped = DistributedDataParallel(
        config=transformer_config, ddp_config=ddp_config, module=model
    )
    transformer_config.finalize_model_grads_func = finalize_model_grads
    if broadcast_params:
        wrapped.broadcast_params()
    if ddp_config.overlap_grad_reduce:
        transformer_config.no_sync_func = wrapped.no_sync
        if align_grad_reduce:
            transformer_config.grad_sync_func = wrapped.start_grad_sync
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        transformer_config.param_sync_func = wrapped.start_param_sync
    return wrapped


def gather_params(ddp_model) -> None:
    """Finish the distributed optimizer's param all-gather of --overlap-param-gather (a no-op without it).

    With the overlap, an optimizer step updates only this rank's shard of each bucket; the other shards arrive
    by the all-gather that DDP's forward pre-hooks start and wait for in the next forward pass. Whatever reads the
    weights outside a forward pass (the export to the engines, checkpoints, weight copies, the replica hash check)
    calls this first: each bucket's all-gather is started where the step left it undone, and waited for."""
    if not getattr(ddp_model, "use_forward_hook", False):
        return
    for group in ddp_model.bucket_groups + ddp_model.expert_parallel_bucket_groups:
        group.finish_param_sync(skip_next_bucket_dispatch=True)


def grads_finite(model) -> bool:
    """Whether every gradient of `model` is finite. Under Megatron's DDP each parameter's `main_grad` is a view of
    a contiguous grad buffer: one check per buffer (padding there is zero) instead of one per parameter."""
    buffers = getattr(model, "buffers", None)  # DDP's list of grad buffers (nn.Module.buffers is a method)
    if isinstance(buffers, list):
        grads = [b.grad_data for b in buffers + list(getattr(model, "expert_parallel_buffers", []))]
    else:
        grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
                 for p in model.parameters()]
    return all(tensor_finite(g) for g in grads if g is not None)


def tensor_finite(t: torch.Tensor) -> bool:
    """Whether every element of `t` is finite, from its smallest and largest element (one pass, no temporary):
    min and max propagate NaN, and an infinity is the max or the min. `torch.isfinite(t).all()` gives the same
    answer through a bool tensor of t's size and a second pass; on SmolLM2-135M's grad buffer (1 thread) that
    took ~1.0-1.5 s of a ~21 s update, this ~0.04 s."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t.detach())  # over every element, whatever the shape or strides (no copy)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def build_optimizer(
    ddp_model,
    transformer_config,
    *,
    lr: float,
    min_lr: float,
    weight_decay: float,
    adam_beta1: float,
    adam_beta2: float,
    adam_eps: float,
    clip_grad: float,
    bf16: bool,
    fp16: bool,
    use_distributed_optimizer: bool,
    initial_loss_scale: float = 2.0**32,
    optimizer: str = "adam",
    sgd_momentum: float = 0.9,
    gpu_features: tuple[str, ...] = (),
    dump_param_to_param_group_map: Optional[str] = None,
    use_gloo_process_groups: bool = True,
    **optimizer_overrides: Any,
):
    """`get_megatron_optimizer` with `optimizer` (adam: AdamW with decoupled weight decay, as Megatron; sgd:
    SGD with `sgd_momentum`); sets the config's loss-scale hook. `initial_loss_scale` (fp16) is Megatron's default,
    as --initial-loss-scale's; `optimizer_overrides`: OptimizerConfig fields
    (relax.backends.megatron.megatron_options.optimizer_fields)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    gpu = {name: True for name in OPTIMIZER_GPU_FEATURES if name in gpu_features}
    if gpu and not torch.cuda.is_available():
        raise ValueError(f"{', '.join('--' + n.replace('_', '-') for n in gpu)} need(s) a GPU and this trainer rank has "
                         "none (relax.config.support_gpu says why); remove them to train on the CPU")
    config = OptimizerConfig(
        **gpu,
        optimizer=optimizer,
        sgd_momentum=sgd_momentum,
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        clip_grad=clip_grad,
        bf16=bf16,
        fp16=fp16,
        params_dtype=transformer_config.params_dtype,
        use_distributed_optimizer=use_distributed_optimizer,
        **{"initial_loss_scale": initial_loss_scale, **optimizer_overrides},
    )
    call: dict[str, Any] = {} if use_gloo_process_groups else {"use_gloo_process_groups": False}
    if dump_param_to_param_group_map is not None:
        call["dump_param_to_param_group_map"] = dump_param_to_param_group_map
    optimizer = get_megatron_optimizer(config, [ddp_model], **call)
    transformer_config.grad_scale_func = optimizer.scale_loss
    return optimizer


def build_scheduler(
    optimizer,
    *,
    lr: float,
    min_lr: float,
    lr_decay_style: str,
    lr_warmup_iters: int,
    lr_decay_iters: Optional[int],
    lr_warmup_init: float,
    weight_decay: float,
    global_batch_size: Optional[int] = None,
    lr_warmup_fraction: Optional[float] = None,
    lr_warmup_samples: int = 0,
    lr_decay_samples: Optional[int] = None,
    lr_wsd_decay_style: str = "exponential",
    lr_wsd_decay_iters: Optional[int] = None,
    lr_wsd_decay_samples: Optional[int] = None,
    start_weight_decay: Optional[float] = None,
    end_weight_decay: Optional[float] = None,
    weight_decay_incr_style: str = "constant",
    override_opt_param_scheduler: bool = False,
    use_checkpoint_opt_param_scheduler: bool = False,
):
    """An `OptimizerParamScheduler` counting optimizer steps (one per train_step), from Megatron-LM's flags as its
    training script turns them into the scheduler's arguments. Megatron-LM counts in samples; one optimizer step is
    one global batch, so `*_samples` flags become steps of `global_batch_size` samples (fractions kept: the
    schedule is the same function of the samples trained). --lr-warmup-fraction is a fraction of the decay steps;
    the weight decay goes from --start-weight-decay to --end-weight-decay over the decay steps (Megatron-LM: over
    --train-iters, which Relax's run does not have)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    def steps(samples: Optional[float]) -> Optional[float]:
        if not samples:  # None (unset) or 0
            return samples
        if not global_batch_size:
            raise ValueError("sample counts of the lr schedule need global_batch_size")
        return samples / global_batch_size

    if lr_decay_samples is not None:
        lr_decay_iters = steps(lr_decay_samples)
    if lr_decay_iters is None:
        if lr_decay_style != "constant" or lr_warmup_fraction is not None or weight_decay_incr_style != "constant":
            raise ValueError(f"lr_decay_style={lr_decay_style!r}, --lr-warmup-fraction and --weight-decay-incr-style "
                             "need lr_decay_iters")
        lr_decay_iters = max(lr_warmup_iters, steps(lr_warmup_samples) or 0) + 1
    if lr_warmup_fraction is not None:
        warmup = lr_warmup_fraction * lr_decay_iters
    elif lr_warmup_samples:
        warmup = steps(lr_warmup_samples)
    else:
        warmup = lr_warmup_iters
    wsd = steps(lr_wsd_decay_samples) if lr_wsd_decay_samples is not None else lr_wsd_decay_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=lr_warmup_init,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=lr_decay_iters,
        lr_decay_style=lr_decay_style,
        start_wd=weight_decay if start_weight_decay is None else start_weight_decay,
        end_wd=weight_decay if end_weight_decay is None else end_weight_decay,
        wd_incr_steps=lr_decay_iters,
        wd_incr_style=weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=override_opt_param_scheduler,
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=lr_wsd_decay_style,
    )
