"""Megatron flags that reach Megatron-core's own config objects as they are: each is one field of its
`TransformerConfig`, `OptimizerConfig`, `DistributedDataParallelConfig` or `OptimizerParamScheduler`, or one argument
of `initialize_model_parallel`, with the meaning, default and checks Megatron gives it.

`options_from_config` collects the flags set to a non-default value (`TrainerSettings.megatron_options`);
relax.backends.megatron.megatron_options hands each group to its Megatron object. The `*_GPU` tables are the flags
Megatron implements with CUDA or Transformer Engine kernels: relax.config.support_gpu refuses them on a CPU-only run
with the reason, and a trainer rank without CUDA refuses them when it builds the model. Everything else here runs on
the CPU (tests/test_megatron_options.py). This module imports no torch: the parser and config checks stay light.
"""

from __future__ import annotations

import enum
from typing import Any

# TransformerConfig fields built on the CPU (Megatron's own flag -> field of the same name).
TRANSFORMER: frozenset[str] = frozenset({
    # initialisation of a model built without --hf-checkpoint / --load
    "init_method_std", "embedding_init_method_std", "perform_initialization", "use_cpu_initialization",
    "init_method_xavier_uniform",
    # numerics of the layers
    "deterministic_mode", "apply_query_key_layer_scaling", "clone_scatter_output_in_embedding",
    "distribute_saved_activations",
})
# Uneven pipeline stages (TransformerConfig fields Megatron's layer assignment reads; tests/test_megatron_pipeline_layout.py)
PIPELINE: frozenset[str] = frozenset({
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
})
# MoE TransformerConfig fields: passed for models with experts (Megatron ignores them for dense ones).
TRANSFORMER_MOE: frozenset[str] = frozenset({
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_input_jitter_eps",
    "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
    "moe_router_force_load_balancing", "moe_layer_recompute",
})
# TransformerConfig fields of CUDA / Transformer Engine features (GPU-only).
TRANSFORMER_GPU: frozenset[str] = frozenset({
    "fp8", "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad",
    "fp4", "fp4_recipe", "fp4_param", "fp8_quantizer_factory", "fp4_quantizer_factory", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16", "use_te_activation_func", "batch_invariant_mode", "symmetric_ar_type",
    "cpu_offloading_num_layers", "fine_grained_activation_offloading", "offload_modules", "min_offloaded_tensor_size",
    "cp_comm_type", "moe_router_padding_for_fp8", "moe_router_padding_for_quantization", "use_kitchen_attention",
    "kitchen_attention_backend", "fp32_residual_connection",
})
# OptimizerConfig fields built on the CPU (the fp16 loss scaler, decoupled lr of the embedding and output layer,
# weight decay of the QK layernorms).
OPTIMIZER: frozenset[str] = frozenset({
    "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis", "decoupled_lr",
    "decoupled_min_lr", "apply_wd_to_qk_layernorm",
    # also a DDP field: Megatron-LM gives the optimizer the same value (its MXFP8 param copy waits for the gather)
    "overlap_param_gather",
})
# OptimizerConfig fields of the precision-aware optimizer and of --optimizer-cpu-offload (GPU-only).
OPTIMIZER_GPU: frozenset[str] = frozenset({
    "main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype", "optimizer_offload_fraction",
    "pin_cpu_grads", "pin_cpu_params", "reuse_grad_buf_for_mxfp8_param_ag",
})
# Megatron-LM's flag -> DistributedDataParallelConfig field, built on the CPU.
DDP: dict[str, str] = {
    "overlap_grad_reduce": "overlap_grad_reduce",
    "ddp_bucket_size": "bucket_size",
    "ddp_average_in_collective": "average_in_collective",
    "ddp_pad_buckets_for_high_nccl_busbw": "pad_buckets_for_high_nccl_busbw",
    "ddp_reduce_scatter_with_fp32_accumulation": "reduce_scatter_with_fp32_accumulation",
    "gradient_reduce_div_fusion": "gradient_reduce_div_fusion",
    "grad_reduce_in_bf16": "grad_reduce_in_fp32",  # Megatron-LM: grad_reduce_in_fp32 = not --grad-reduce-in-bf16
    "ddp_num_buckets": "num_buckets",  # wrap_ddp: the bucket size is the parameter count over it, as Megatron-LM
    # not a DDP field: with overlap_grad_reduce, whether the schedules get DDP's start_grad_sync (wrap_ddp)
    "align_grad_reduce": "align_grad_reduce",
    # the distributed optimizer's param all-gather overlapped with the next forward pass: DDP's forward pre-hooks
    # wait for each bucket; the trainer finishes the gather before it reads the weights otherwise (optim.gather_params)
    "overlap_param_gather": "overlap_param_gather",
    "align_param_gather": "align_param_gather",  # --no-align-param-gather: each bucket's hook starts the next one
    # each bucket's local gradient norm checked before the reduce (Megatron's rerun state machine warns)
    "check_for_large_grads": "check_for_large_grads",
    # the distributed optimizer sharded over DP / N ranks, gradients all-reduced across the N instances (also an
    # initialize_model_parallel argument: PARALLEL)
    "num_distributed_optimizer_instances": "num_distributed_optimizer_instances",
}
# NCCL user buffers for the DDP param and grad buffers (GPU-only).
DDP_GPU: dict[str, str] = {"fp8_param_gather": "fp8_param_gather", "keep_fp8_transpose_cache": "keep_fp8_transpose_cache",
                           "nccl_ub": "nccl_ub", "disable_symmetric_registration": "disable_symmetric_registration"}
# OptimizerParamScheduler settings (relax.backends.megatron.optim.build_scheduler), built on the CPU.
SCHEDULER: frozenset[str] = frozenset({
    "lr_warmup_fraction", "lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_style", "lr_wsd_decay_iters",
    "lr_wsd_decay_samples", "start_weight_decay", "end_weight_decay", "weight_decay_incr_style",
    "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler",
})
# initialize_model_parallel / RNG arguments of NCCL or Transformer Engine features (GPU-only).
PARALLEL_GPU: frozenset[str] = frozenset({
    "use_sharp", "sharp_enabled_group", "high_priority_stream_groups", "nccl_communicator_config_path",
    "hierarchical_context_parallel_sizes", "te_rng_tracker", "create_all_gather_group",
})
PARALLEL: frozenset[str] = frozenset({"use_gloo_process_groups", "use_tp_pp_dp_mapping", "data_parallel_random_init",
                                      "num_distributed_optimizer_instances"})
# Process-wide Megatron switches Megatron-LM's initialisation applies (megatron.core.config.set_experimental_flag,
# megatron.core.jit.disable_jit_fuser), and get_megatron_optimizer's dump of each parameter's group.
# How the model is built (relax.backends.megatron.model.build_gpt_model): Megatron's --spec and --transformer-impl
# local (the local layer spec instead of Transformer Engine's), and Relax's --custom-model-provider-path.
MODEL: frozenset[str] = frozenset({"spec", "transformer_impl", "custom_model_provider_path"})
# What a checkpoint holds and restores (relax.backends.megatron.checkpoint).
CHECKPOINT: frozenset[str] = frozenset({"no_save_rng", "no_load_rng"})
# Checked before Ray (relax.config.rules_training.check_exit_on_missing_checkpoint), not passed to the trainer.
CONFIG_ONLY: frozenset[str] = frozenset({"exit_on_missing_checkpoint"})
# Checks after each optimizer step (relax.backends.megatron.megatron_options.check_weight_hashes).
# --distributed-timeout-seconds-after-init: every process group's timeout once the first optimizer step is done.
STEP: frozenset[str] = frozenset({"check_weight_hash_across_dp_replicas_interval", "distributed_timeout_seconds_after_init"})
PROCESS: frozenset[str] = frozenset({"enable_experimental", "disable_jit_fuser", "dump_param_to_param_group_map"})

# The --flag of each option whose name is not its dest's (for the messages of a trainer rank, which has no parser).
FLAG_NAMES: dict[str, str] = {
    "fp8": "--fp8-format", "fp4": "--fp4-format", "fp4_param": "--fp4-param-gather", "fp8_wgrad": "--no-fp8-wgrad",
    "pin_cpu_grads": "--no-pin-cpu-grads", "pin_cpu_params": "--no-pin-cpu-params", "nccl_ub": "--use-nccl-ub",
}
GPU_OPTIONS: frozenset[str] = TRANSFORMER_GPU | OPTIMIZER_GPU | frozenset(DDP_GPU) | PARALLEL_GPU
CPU_OPTIONS: frozenset[str] = (TRANSFORMER | PIPELINE | TRANSFORMER_MOE | OPTIMIZER | frozenset(DDP) | SCHEDULER | PARALLEL
                               | PROCESS | CHECKPOINT | MODEL | STEP | CONFIG_ONLY | {"no_weight_decay_cond_type"})
ALL_OPTIONS: frozenset[str] = GPU_OPTIONS | CPU_OPTIONS

def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, list):
        return tuple(value)
    return value


def same_value(a: Any, b: Any) -> bool:
    """Equal as flag values (enums by name, a list of one as its element)."""
    a, b = _plain(a), _plain(b)
    if isinstance(a, tuple) and len(a) == 1:
        a = a[0]
    if isinstance(b, tuple) and len(b) == 1:
        b = b[0]
    return a == b


def options_from_config(config: Any) -> tuple[tuple[str, Any], ...]:
    """(dest, value) of each flag of this module set to a value other than its default, sorted by dest.

    Megatron's load-balancing type goes with any load-balancing coefficient: Relax builds MoE routers with type none
    (the same as Megatron's default aux_loss with coefficient 0), so a coefficient alone gets the flag's type."""
    defaults = config.meta.get("defaults", {})
    out = {dest: _plain(config[dest]) for dest in ALL_OPTIONS
           if dest in config and not (dest in defaults and same_value(config[dest], defaults[dest]))}
    if {"moe_aux_loss_coeff", "moe_z_loss_coeff"} & set(out):
        out.setdefault("moe_router_load_balancing_type", _plain(config["moe_router_load_balancing_type"]))
    if {"lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_samples"} & set(out):
        out["global_batch_size"] = config["global_batch_size"]  # one optimizer step is one global batch
    return tuple(sorted(out.items()))
# Megatron's help of each flag above (its Megatron-LM 0.17 parser, else the megatron-core 0.16 field's docstring),
# with what Relax counts differently; relax.config.help_text adds the GPU-only reason.
OPTION_HELP: dict[str, str] = {
    "data_parallel_random_init": "Enable random initialization of params across data parallel ranks.",
    "exit_on_missing_checkpoint": ("If '--load' is set, but checkpoint is not found (e.g., path typo), then exit "
                                   "instead of random initialization (Relax: instead of starting from the initial "
                                   "weights)."),
    "init_method_xavier_uniform": "Enable Xavier uniform parameter initialization.",
    "use_tp_pp_dp_mapping": ("If set, distributed ranks initialize order is changed from tp-cp-ep-dp-pp to "
                             "tp-cp-ep-pp-dp."),
    "decoder_first_pipeline_num_layers": ("The number of transformer layers on the first pipeline stage of the "
                                          "decoder. Default None is even split of transformer layers across all "
                                          "pipeline stages."),
    "decoder_last_pipeline_num_layers": ("The number of transformer layers on the last pipeline stage of the decoder. "
                                         "Default None is even split of transformer layers across all pipeline "
                                         "stages."),
    "account_for_embedding_in_pipeline_split": ("If set, *input* embedding layer will be treated as a standard "
                                                "transformer layer in the context of partition and placement for "
                                                "pipeline parallelism."),
    "account_for_loss_in_pipeline_split": ("If set, loss layer will be treated as a standard transformer layer in "
                                           "the context of partition and placement for pipeline parallelism."),
    "fp32_residual_connection": "Move residual connections to fp32.",
    "use_kitchen_attention": "Use coarse-grained kitchen attention (Megatron's NVIDIA Kitchen integration).",
    "kitchen_attention_backend": "The backend of kitchen attention (sdpa or fa).",
    "ddp_num_buckets": ("Number of buckets for data-parallel communication (the bucket size is the parameter count "
                        "over it)."),
    "check_weight_hash_across_dp_replicas_interval": ("Interval to check weight hashes are same across DP replicas "
                                                      "(in optimizer steps)."),
    "spec": ("Specify the <module_location function_name> pair that returns a spec to customize a model, transformer "
             "block, or transformer layer, depending on the use case. To use local spec specify local as the "
             "argument (Relax: the object is the transformer layer spec, called first when it is a function)."),
    "transformer_impl": ("Which Transformer implementation to use: local builds Megatron's own layers; "
                         "transformer_engine (the default) Transformer Engine's where CUDA and transformer_engine "
                         "are present (the local ones otherwise, as on CPU)."),
    "no_save_rng": "Do not save current rng state.",
    "no_load_rng": "Do not load rng state when loading checkpoint.",
    "enable_experimental": "Enable experimental features.",
    "disable_jit_fuser": "Disable the JIT fuser.",
    "dump_param_to_param_group_map": "Path to a file to dump parameter to param group map.",
    "overlap_param_gather": ("If set, overlap param all-gather in distributed optimizer (needs "
                             "--use-distributed-optimizer and --overlap-grad-reduce; Relax finishes the gather before "
                             "it exports, saves or copies the weights)."),
    "align_param_gather": ("If not set, all PP stages will launch param all-gathers simultaneously. Otherwise, each PP "
                           "stage will independently launch as needed (Relax runs no interleaved pipeline schedule: "
                           "--no-align-param-gather makes the wait for each bucket's all-gather start the next "
                           "bucket's; by default each bucket's starts when its first layer runs)."),
    "check_for_large_grads": ("Check for unexpectedly large grads (Relax runs Megatron's rerun state machine "
                              "disabled: a bucket's local gradient norm over 10x the largest of its first 100 checks "
                              "is logged as a warning before the reduce, and the step goes on)."),
    "num_distributed_optimizer_instances": ("Number of Distributed Optimizer copies across Data Parallel domain "
                                            "(needs --use-distributed-optimizer; it must divide the data-parallel "
                                            "size)."),
    "nccl_ub": ("Use the userbuffer registration for DP/FSDP communication buffers. This option will reduce GPU SM "
                "usage for the DP/FSDP communication, which is improving the performance of the overlapped "
                "computation."),
    "disable_symmetric_registration": ("Disable symmetric (window) registration for NCCL userbuffer registration. "
                                       "This option will force to use conventional (local) userbuffer registration "
                                       "when use-nccl-ub is set."),
    "create_all_gather_group": ("Create a separate process group for all-gather operations to overlap "
                                "reduce-scatter and all-gather operations."),
    "distributed_timeout_seconds_after_init": ("Timeout in seconds for process groups after initialization. This "
                                               "timeout is applied to all process groups after initialization and "
                                               "the first iteration completes (Relax: the trainer's first optimizer "
                                               "step of the run)."),
    "align_grad_reduce": (
        "If not set, all PP stages will launch gradient reduces simultaneously. Otherwise, each PP stage will "
        "independently launch as needed."),
    "apply_query_key_layer_scaling": (
        "If true, scale Q * K^T by 1 / layer-number. This improve numeric stability when training with fp16. "
        "Also sets `attention_softmax_in_fp32` to True."),
    "apply_wd_to_qk_layernorm": "Apply weight decay to qk layernorm as a special case.",
    "batch_invariant_mode": (
        "If true, uses batch-invariant kernels that provide deterministic forward execution regardless of "
        "batch size. This ensures bitwise identical results when the same inputs are processed in different "
        "batch configurations. This will significantly affect speed of training and inference as the kernels "
        "are not full optimized. Defaults to False."),
    "clone_scatter_output_in_embedding": (
        "When set to True, clone the output of scatter_to_sequence_parallel_region in embedding layer to "
        "facilitate garbage collection of input."),
    "cp_comm_type": (
        "Inter-gpu communication type for context parallelism: p2p, a2a, allgather or a2a+p2p. If a single "
        "string is provided, all layers will share the same communication type. Users can also specify "
        "separated types for each layer like --cp-comm-type p2p p2p a2a a2a a2a+p2p a2a+p2p."),
    "cpu_offloading_num_layers": "Tells the number of transformer layers for which activations has to be offloaded.",
    "ddp_average_in_collective": "If set, average directly in data-parallel communication collective.",
    "ddp_bucket_size": "Bucket size for data-parallel communication.",
    "ddp_pad_buckets_for_high_nccl_busbw": (
        "If set, make sure the bucket size is divisible by a large power of 2 (2^16) to ensure NCCL "
        "collectives have high bus bandwidth at large DP counts, since NCCL message size (which for ring "
        "algorithms is bucket_size / dp_size) apparently needs to be divisible by a power of 2 for high "
        "busbw."),
    "ddp_reduce_scatter_with_fp32_accumulation": (
        "If set, use a reduce-scatter implementation which sends lower-precision values over the wire (using "
        "an all-to-all to keep total communication overhead in line with the standard ring implementation) "
        "but performs accumulation locally in FP32."),
    "decoupled_lr": "Separate learning rate for the input and output layer.",
    "decoupled_min_lr": (
        "Minimum value for learning rate for the input and output layer. The schedulerclip values below this "
        "threshold."),
    "deterministic_mode": (
        "If true, code that has deterministic execution will be chosen. This usually means slower execution, "
        "but is good for debugging and testing. Defaults to False."),
    "distribute_saved_activations": "If True, distribute recomputed activations across the model parallel group.",
    "embedding_init_method_std": (
        "Standard deviation of the zero mean normal for the default initialization method for the embedding "
        "layer. If None, will be set to init_method_std. Setting this to a value around 1.0 may avoid loss "
        "spikes in training. Setting this to any value will also skip applying weight decay on embedding "
        "weights to avoid shrinkage towards zero. See https://arxiv.org/abs/2312.16903 for more details."),
    "end_weight_decay": (
        "End of run weight decay coefficient for L2 regularization (Relax: reached at --lr-decay-iters, as "
        "Relax's run has no --train-iters)."),
    "exp_avg_dtype": (
        "Dtype of exp_avg (1st moment in adam optimizer) when enabling precision-aware-optimizer. This dtype "
        "is used for storing the optimizer state in memory during training but does not affect the precision "
        "in the kernel computation."),
    "exp_avg_sq_dtype": (
        "Dtype of exp_avg_sq (2nd moment in adam optimizer) when enabling precision-aware-optimizer. This "
        "dtype is used for storing the optimizer state in memory during training but does not affect the "
        "precision in the kernel computation."),
    "fine_grained_activation_offloading": (
        "If True, offload the input of the specified modules to the CPU. Fine-grained activation offloading "
        "is a module-level offloading method instead of a layer-level offloading method like cpu_offloading."),
    "first_last_layers_bf16": "If True, retains first and last N TransformerBlocks in BF16 as opposed to FP8.",
    "fp4": (
        "If set, enables the use of FP4 precision through Transformer Engine. Currently only supports 'nvfp4' "
        "which uses NVFP4BlockScaling recipe (requires TE >= 2.7.0.dev0)."),
    "fp4_param": (
        "If set, keep the parameters in fp4 precision to save memory. This option must be used together with "
        "fp4 mode (i.e., TransformerConfig.fp4 is not None). Note that not all parameters will be converted "
        "to fp4; for example, biases will remain unchanged."),
    "fp4_quantizer_factory": (
        "Python import path to a callable quantizer factory, e.g., package.module.quantizer_factory. Required "
        "when fp4_recipe is custom."),
    "fp4_recipe": (
        "If set, enables the use of FP4 precision through Transformer Engine. Currently only 'nvfp4' is "
        "supported which uses NVFP4BlockScaling recipe for Blackwell+ architecture."),
    "fp8": (
        "If set, enables the use of FP8 precision through Transformer Engine. There are 2 predefined choices "
        "(1) 'e4m3' uniformly uses e4m3 for all FP8 tensors, (2) 'hybrid' uses e4m3 for all FP8 activation "
        "and weight tensors and e5m2 for all FP8 output activation gradient tensors."),
    "fp8_amax_compute_algo": (
        "Algorithm used for choosing the `amax` value for the scaling factor computation. There are 2 "
        "predefined choices: `max` chooses the largest `amax` in the history window, while `most_recent` "
        "always chooses the most recently seen value."),
    "fp8_amax_history_len": "The length of the amax history window used for scaling factor computation.",
    "fp8_interval": (
        "DEPRECATED from TransformerEngine v1.8.0. This flag is ignored. Controls how often the scaling "
        "factor is recomputed."),
    "fp8_margin": "Margin for the scaling factor computation.",
    "fp8_param_gather": (
        "Keep the compute param in fp8 (do not use any other intermediate dtype) and perform the param all- "
        "gather in fp8."),
    "fp8_quantizer_factory": (
        "Python import path to a callable quantizer factory, e.g., package.module.quantizer_factory. Required "
        "when fp8_recipe is custom."),
    "fp8_recipe": (
        "If set, enables the use of FP8 precision through Transformer Engine. There are 5 predefined choices "
        "(1) 'tensorwise' uses per tensor current scaling recipe, (2) 'delayed' uses delayed scaling recipe, "
        "3) 'mxfp8' for Blackwell architecture only, 4) 'blockwise' for blockwise scaling recipe, 5) 'custom' "
        "for custom quantization recipe."),
    "fp8_wgrad": "When set to False, override FP8 config options and do the wgrad computation in higher precision.",
    "grad_reduce_in_bf16": "Reduce gradients in bfloat16.",
    "gradient_reduce_div_fusion": "If not set, fuse the division in gradient reduce.",
    "hierarchical_context_parallel_sizes": (
        "Degrees of the hierarchical context parallelism. Users should provide a list to specify the sizes "
        "for different levels. Taking the a2a+p2p cp comm type as example, it contains groups of two levels, "
        "so the first value of the list indicates the group size of the a2a communication type, and the "
        "second value indicates the group size of the p2p communication type."),
    "high_priority_stream_groups": "The communicator group names to use high priority streams.",
    "hysteresis": "hysteresis for dynamic loss scaling.",
    "init_method_std": (
        "Standard deviation of the zero mean normal for the default initialization method, not used if "
        "init_method and output_layer_init_method are provided."),
    "initial_loss_scale": "Initial loss-scale for dynamic loss scaling.",
    "keep_fp8_transpose_cache": "If set, keep the fp8 transpose cache when using Megatron FSDP.",
    "loss_scale": (
        "Static loss scaling, positive power of 2 values can improve fp16 convergence. If None, dynamicloss "
        "scaling is used."),
    "loss_scale_window": "Window over which to raise/lower dynamic scale.",
    "lr_decay_samples": (
        "Number of samples to decay learning rate over (Relax: one optimizer step is one --global-batch-size "
        "of samples)."),
    "lr_warmup_fraction": "Fraction of lr-warmup-(iters/samples) to use for warmup (as a float): a fraction of the decay steps.",
    "lr_warmup_samples": (
        "Number of samples to linearly warmup learning rate over (Relax: one optimizer step is one --global- "
        "batch-size of samples)."),
    "lr_wsd_decay_iters": "Number of iterations for the annealing phase in the wsd schedule.",
    "lr_wsd_decay_samples": (
        "Number of samples for the annealing phase in the wsd schedule (Relax: one optimizer step is one "
        "--global-batch-size of samples)."),
    "lr_wsd_decay_style": "Decay style for the annealing phase of WSD.",
    "main_grads_dtype": "Dtype of main grads when enabling precision-aware-optimizer.",
    "main_params_dtype": "Dtype of main params when enabling precision-aware-optimizer.",
    "min_loss_scale": "Minimum loss scale for dynamic loss scaling.",
    "min_offloaded_tensor_size": "The minimum size of the tensor to be offloaded.",
    "moe_aux_loss_coeff": "Scaling coefficient for the aux loss: a starting value of 1e-2 is recommended.",
    "moe_expert_capacity_factor": (
        "moe_expert_capacity_factor (float): The capacity factor for each expert, None means no token will be "
        "dropped. The default is None."),
    "moe_input_jitter_eps": "Add noise to the input tensor by applying jitter with a specified epsilon value.",
    "moe_layer_recompute": "Memory optimization: checkpointing moe_layer to save actiavtion memory.",
    "moe_pad_expert_input_to_capacity": (
        "moe_pad_expert_input_to_capacity (bool): If True, pads the input for each expert to match the expert "
        "capacity length, effective only after the moe_expert_capacity_factor is set. The default setting is "
        "False."),
    "moe_router_force_load_balancing": (
        "[Experimental] Force load balancing with random logits for MoE router, supports naive topk and "
        "group-limited topk. This is an experimental feature and only for benchmark."),
    "moe_router_load_balancing_type": (
        "Determines the load balancing strategy for the router. 'aux_loss' corresponds to the load balancing "
        "loss used in GShard and SwitchTransformer; 'seq_aux_loss' corresponds to the load balancing loss "
        "used in DeepSeekV2, which computes the loss for each individual sample; 'sinkhorn' corresponds to "
        "the balancing algorithm used in S-BASE, and 'none' implies no load balancing. The default is "
        "'aux_loss'."),
    "moe_router_padding_for_fp8": (
        "[Compatibility alias for moe_router_padding_for_quantization] Enabling this will also enable "
        "moe_router_padding_for_quantization."),
    "moe_router_padding_for_quantization": (
        "Whether to pad the routing_map to make sure the number of tokens each expert receives is a multiple "
        "of 16/32 for quantized precision (e.g., FP8, FP4). This can remove the explicit padding in the "
        "GroupedMLP layer."),
    "moe_token_drop_policy": (
        "The policy to drop tokens. Can be either 'probs' or 'position'. If 'probs', the tokens with the "
        "lowest probabilities will be dropped. If 'position', tokens at the end of each batch will be "
        "dropped."),
    "moe_z_loss_coeff": "Scaling coefficient for the z-loss. A starting value of 1e-3 is recommended.",
    "nccl_communicator_config_path": "Path to the yaml file with NCCL communicator configurations.",
    "no_weight_decay_cond_type": (
        "Type of no weight decay condition. Choices: None (default): apply weight decay to 1D weights and "
        "biases.'apply_wd_to_qk_layernorm': additionally apply weight decay to qk layernorm as a special "
        "case.DEPRECATED. Please use --apply-wd-to-qk-layernorm instead."),
    "num_layers_at_end_in_bf16": (
        "Number of layers at the end of the model to keep in BF16 precision when first_last_layers_bf16 is "
        "True."),
    "num_layers_at_start_in_bf16": (
        "Number of layers at the start of the model to keep in BF16 precision when first_last_layers_bf16 is "
        "True."),
    "offload_modules": (
        "The submodules to offload its input. choices: 'attn_norm', 'qkv_linear', 'core_attn', 'attn_proj', "
        "'mlp_norm', 'expert_fc1', 'moe_act'. 'attn_norm': offload the input of the normalization in the "
        "attention part. 'qkv_linear': offload the input of the qkv linear part. 'core_attn': offload the "
        "input of the core attention part. 'attn_proj': offload the input of the attn linear projection part. "
        "'mlp_norm': offload the input of the normalization in the mlp part. 'expert_fc1': offload the input "
        "of the expert fc1 part. 'moe_act': offload the input of the moe act part."),
    "optimizer_offload_fraction": "Ratio of optimizer state to offload to CPU.",
    "overlap_grad_reduce": "If set, overlap DDP grad reduce.",
    "override_opt_param_scheduler": (
        "Reset the values of the scheduler (learning rate, warmup iterations, minimum learning rate, maximum "
        "number of iterations, and decay style) from input arguments and ignore values from checkpoints."),
    "perform_initialization": (
        "Controls weights initialization. This option can be useful when you know you are going to load "
        "values from a checkpoint."),
    "pin_cpu_grads": "Disable pinning of CPU memory for gradients.",
    "pin_cpu_params": "Disable pinning of CPU memory for parameters.",
    "reuse_grad_buf_for_mxfp8_param_ag": "If True, reuse the grad buffer for MXFP8 parameter all-gather.",
    "sharp_enabled_group": "IB SHARP can be enabled from only one communication group; this names the group.",
    "start_weight_decay": "Initial weight decay coefficient for L2 regularization (Relax: at the first optimizer step).",
    "symmetric_ar_type": "What type of symmetric all reduce to use. The default is None which is no use of symmetric memory.",
    "te_rng_tracker": "Use the Transformer Engine version of the random number generator.",
    "use_checkpoint_opt_param_scheduler": (
        "Use checkpoint to set the values of the scheduler (learning rate, warmup iterations, minimum "
        "learning rate, maximum number of iterations, and decay style) from checkpoint and ignore input "
        "arguments."),
    "use_cpu_initialization": (
        "When set to False, we initialize the weights directly on the GPU. CPU initialization is the same "
        "regardless of tensor model parallelism, but GPU initialization is not. Transferring weights from CPU "
        "to GPU can take a significant amount of time for large models."),
    "use_gloo_process_groups": "Disables creation and usage of Gloo process groups.",
    "use_sharp": "Required to enable SHARP communication.",
    "use_te_activation_func": "Whether to use ffn activation functions implemented by TransformerEngine.",
    "weight_decay_incr_style": "Weight decay increment function (over --lr-decay-iters optimizer steps in Relax).",
}
