"""Typed settings at the role/backend boundary: a run's flat config -> `TrainerSettings` for a Megatron rank
(actor, reference, teacher, critic), where the reference lives, and the reference model's build.

Apart from the roles' Ray actors (relax.roles.trainer and its siblings) so that the reference's child process
(relax.roles.reference_child) builds its model without importing Ray, the data plane or the rewards (~0.5 s of
CPU at every start on 2 cores). Megatron-core itself loads only where a model is built (`build_reference_trainer`):
the driver imports this module through the roles' actor classes, and Megatron's import would cost it seconds of CPU
at every launch."""

from __future__ import annotations

from typing import Any

from relax.formats.model_arch import arch_for_run
from relax.backends.megatron.lora import lora_settings
from relax.backends.megatron.settings import TrainerSettings
from relax.config.megatron_options import options_from_config
from relax.config.support_gpu import GPU_ONLY_REASONS


def trainer_settings(config: Any, *, forward_only: bool = False):
    dynamic = bool(config.use_dynamic_batch_size)
    # Megatron: --recompute-activations is --recompute-granularity selective (checked in rules_recompute).
    granularity = config.recompute_granularity or ("selective" if config.recompute_activations else None)
    backend = getattr(config.attention_backend, "name", config.attention_backend)  # an enum from Megatron's parser
    return TrainerSettings(
        forward_only=forward_only,
        trainable_params=tuple(config.only_train_params_name_list or ()) if not forward_only else (),
        frozen_params=tuple(config.freeze_params_name_list or ()) if not forward_only else (),
        max_tokens_per_micro_batch=config.max_tokens_per_gpu if dynamic else None,
        logprob_max_tokens_per_micro_batch=config.log_probs_max_tokens_per_gpu if dynamic else None,
        tp=config.tensor_model_parallel_size, pp=config.pipeline_model_parallel_size,
        sequence_parallel=bool(config.sequence_parallel),
        cp=config.context_parallel_size, allgather_cp=bool(config.allgather_cp), ep=config.expert_model_parallel_size,
        etp=config.expert_tensor_parallel_size, lr=config.lr, min_lr=config.min_lr or 0.0,
        lr_decay_style=config.lr_decay_style, lr_warmup_iters=config.lr_warmup_iters or 0,
        lr_warmup_init=config.lr_warmup_init,
        lr_decay_iters=config.lr_decay_iters, weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
        optimizer=config.optimizer, sgd_momentum=config.sgd_momentum,
        gpu_features=tuple(name for name in GPU_ONLY_REASONS if config[name]),
        clip_grad=config.clip_grad, seed=config.seed, bf16=bool(config.bf16), fp16=bool(config.fp16),
        use_distributed_optimizer=bool(config.use_distributed_optimizer),
        micro_batch_size=config.micro_batch_size,
        logprob_chunk_size=None if config.log_probs_chunk_size in (None, -1) else config.log_probs_chunk_size,
        recompute_loss_function=bool(config.recompute_loss_function) and not forward_only,
        routing_replay=bool(config.use_routing_replay) and not forward_only,
        # Forward-only roles run without autograd: recompute has nothing to save there.
        recompute_granularity=None if forward_only else granularity,
        recompute_method=None if forward_only else config.recompute_method,
        recompute_num_layers=None if forward_only else config.recompute_num_layers,
        recompute_modules=None if forward_only or not config.recompute_modules else tuple(config.recompute_modules),
        # Relax's default is 0 (relax.config.megatron.RELAX_DEFAULT_OVERRIDES), Megatron's 0.1
        hidden_dropout=float(config.hidden_dropout), attention_dropout=float(config.attention_dropout),
        attention_backend=backend, moe_router_dtype=config.moe_router_dtype,
        megatron_options=options_from_config(config),
        # every model of the run gets the adapters: forward-only copies (reference, the old policy's) keep B = 0
        # (the frozen base, bit for bit) until the actor's weights are copied in
        lora=lora_settings(config),
    )


def build_reference_trainer(config: Any) -> tuple[Any, str]:
    """The reference model (forward only, the actor's architecture and parallel layout): --hf-checkpoint's weights,
    then --ref-load's if given. Returns (a MegatronTrainer, where its weights came from)."""
    from relax.backends.megatron.trainer import MegatronTrainer  # loads Megatron-core: see the module docstring

    trainer = MegatronTrainer(arch_for_run(config), trainer_settings(config, forward_only=True))
    source = "random"
    if config.hf_checkpoint:
        source = "hf"
        trainer.load_hf(config.hf_checkpoint)
    if config.ref_load:
        source = trainer.load_weights(config.ref_load, config.ref_ckpt_step)
    return trainer, source
