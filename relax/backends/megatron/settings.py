"""`TrainerSettings`: the parallel layout, optimizer, schedule and precision of a `MegatronTrainer`, as plain values.

Apart from the trainer (relax.backends.megatron.trainer, which re-exports it) because the roles build it from a
run's config in processes that never train: the driver imports the roles' modules for their Ray actor classes, and
the trainer's module loads Megatron-core at its top (seconds of CPU at every launch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["TrainerSettings"]


@dataclass(frozen=True)
class TrainerSettings:
    """Parallel layout, optimizer, schedule and precision of a `MegatronTrainer`."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    allgather_cp: bool = False  # --allgather-cp: TE's all-gather exchange under CP (its ring otherwise)
    ep: int = 1
    etp: Optional[int] = None
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_decay_style: str = "constant"  # constant | linear | cosine | inverse-square-root | WSD
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None
    lr_warmup_init: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    optimizer: str = "adam"  # adam | sgd: Megatron's get_megatron_optimizer
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False
    use_distributed_optimizer: bool = False
    micro_batch_size: int = 1
    logprob_chunk_size: Optional[int] = None
    sequence_parallel: bool = False
    recompute_activations: bool = False  # full recompute, one layer at a time (older switch)
    # Megatron-core's activation recompute, dropout and attention backend (relax.backends.megatron.layer_options).
    recompute_granularity: Optional[str] = None  # full | selective
    recompute_method: Optional[str] = None  # uniform | block (full only)
    recompute_num_layers: Optional[int] = None  # full only
    recompute_modules: Optional[tuple[str, ...]] = None  # selective only; Megatron's default: core_attn
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    attention_backend: str = "auto"  # flash | fused (Transformer Engine) | unfused | local | auto
    moe_router_dtype: Optional[str] = None  # fp32 | fp64: the router's logits and softmax (MoE models)
    gpu_features: tuple[str, ...] = ()  # GPU-only Megatron switches that are on (relax.config.support_gpu)
    use_te: Optional[bool] = None
    pad_token_id: int = 0
    # Forward-only (reference / teacher): no DDP grad buffers, optimizer or scheduler.
    forward_only: bool = False
    # Parameter selection by regex (re.search) on Megatron parameter names; exclusive.
    trainable_params: tuple[str, ...] = ()
    frozen_params: tuple[str, ...] = ()
    # Dynamic batch size: micro-batches by a padded-token budget instead of micro_batch_size.
    max_tokens_per_micro_batch: Optional[int] = None
    logprob_max_tokens_per_micro_batch: Optional[int] = None
    # Critic: the LM head is replaced by a scalar value head (relax.backends.megatron.model.ValueHead);
    # `compute_values` instead of `compute_logprobs`, and `train_step`'s loss_fn gets values, not log-probs.
    value_head: bool = False
    # --recompute-loss-function: logits -> log-probs -> loss of each micro-batch runs under activation
    # checkpointing (torch.utils.checkpoint): its float32 softmax intermediates are freed after the forward pass
    # and recomputed in backward (the loss function runs twice per micro-batch).
    recompute_loss_function: bool = False
    # --use-routing-replay: MoE routers get Megatron's RouterReplay; `compute_logprobs_and_routes` records
    # each sample's top-k experts and `train_step` replays samples' `routed_experts` (see routing_replay.py).
    routing_replay: bool = False
    # Megatron flags passed to Megatron-core's config objects as they are, (dest, value) of those set to a
    # non-default value (relax.backends.megatron.megatron_options)
    megatron_options: tuple[tuple[str, Any], ...] = ()
    lora: Optional[Any] = None  # LoRA adapters, base frozen (a relax.backends.megatron.lora.LoraSettings)
