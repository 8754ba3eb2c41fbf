"""Megatron DDP wrapper, optimizer and learning-rate scheduler for one model chunk."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["wrap_ddp", "build_optimizer", "build_scheduler"]

# Megatron's own GPU optimizer features, switched on by their flags (relax.config.support_gpu)
OPTIMIZER_GPU_FEATURES = ("optimizer_cpu_offload", "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer",
                          "use_torch_optimizer_for_cpu_offload")


def wrap_ddp(model: torch.nn.Module, transformer_config, *, use_distributed_optimizer: bool):
    """Wrap a GPTModel in Megatron's DDP (contiguous grad buffers, `main_grad`).

    Also points the config at `finalize_model_grads`, which all-reduces
    gradients over data-parallel ranks (and embeddings over pipeline ends).
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    wrapped = DistributedDataParallel(
        config=transformer_config, ddp_config=ddp_config, module=model
    )
    transformer_config.finalize_model_grads_func = finalize_model_grads
    return wrapped


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
    initial_loss_scale: float = 2.0**16,
    optimizer: str = "adam",
    sgd_momentum: float = 0.9,
    gpu_features: tuple[str, ...] = (),
):
    """`get_megatron_optimizer` with `optimizer` (adam: AdamW with decoupled weight decay, as Megatron; sgd:
    SGD with `sgd_momentum`); sets the config's loss-scale hook."""
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
        initial_loss_scale=initial_loss_scale,
    )
    optimizer = get_megatron_optimizer(config, [ddp_model])
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
):
    """An `OptimizerParamScheduler` counting optimizer steps (one per train_step)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if lr_decay_iters is None:
        if lr_decay_style != "constant":
            raise ValueError(f"lr_decay_style={lr_decay_style!r} needs lr_decay_iters")
        lr_decay_iters = lr_warmup_iters + 1
    return OptimizerParamScheduler(
        optimizer,
        init_lr=lr_warmup_init,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=lr_warmup_iters,
        lr_decay_steps=lr_decay_iters,
        lr_decay_style=lr_decay_style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=lr_decay_iters,
        wd_incr_style="constant",
    )
