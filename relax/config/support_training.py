"""Training-side flags whose features are built (see relax.config.support). Add a dest only with its
code and test."""

from relax.formats.model_arch import BUILDABLE_FLAGS, SIZE_FLAGS
from relax.config.megatron_options import CPU_OPTIONS
from relax.config.support_gpu import GPU_ONLY_FEATURES

# Megatron's architecture flags: checked against the --hf-checkpoint config before the run
# (relax.config.rules_arch), the model is built from that config (tests/test_arch_flags.py). The flags of
# features no supported model family has (--qk-l2-norm, --multi-latent-attention, ...) stay refused when set.
ARCH_FEATURES: frozenset[str] = BUILDABLE_FLAGS | frozenset(SIZE_FLAGS)

TRAINING_FEATURES: frozenset[str] = ARCH_FEATURES | GPU_ONLY_FEATURES | CPU_OPTIONS | frozenset({
    # reference role and KL (tests/test_training_*.py, tests/test_training_e2e.py)
    "use_kl_loss", "kl_loss_coef", "kl_loss_type", "use_unbiased_kl", "kl_coef", "ref_load", "ref_ckpt_step",
    "ref_update_interval", "gamma",
    # off-policy corrections and loss hooks
    "use_tis", "tis_clip", "tis_clip_low", "use_opsm", "opsm_delta", "get_mismatch_metrics",
    "custom_tis_function_path", "custom_pg_loss_reducer_function_path", "custom_loss_function_path",
    # trainer options
    "only_train_params_name_list", "freeze_params_name_list", "reset_optimizer_states",
    "use_dynamic_batch_size", "max_tokens_per_gpu", "log_probs_max_tokens_per_gpu",
    # PPO with a critic role (tests/test_training_critic.py, tests/test_training_e2e_ppo.py)
    "lambd", "value_clip", "num_critic_only_steps", "critic_train_only", "critic_lr", "critic_lr_warmup_iters",
    "critic_load", "critic_save",
    # on-policy distillation with a Megatron teacher role
    "use_opd", "opd_type", "opd_kl_coef", "opd_teacher_load", "opd_teacher_ckpt_step",
    # training data, old policy and loss memory (tests/test_training_flags_*.py)
    "disable_compute_advantages_and_returns", "custom_reward_post_process_path",
    "custom_convert_samples_to_train_data_path", "use_rollout_entropy", "recompute_loss_function",
    "keep_old_actor", "true_on_policy_mode",
    # MoE routing replay (tests/test_routing_replay.py)
    "use_routing_replay",
    # rollout routing replay, R3 (tests/test_rollout_routing_replay.py)
    "use_rollout_routing_replay",
    # Megatron-core's activation recompute (relax.backends.megatron.layer_options; tests/test_megatron_recompute.py)
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules", "recompute_activations",
    # dropout, attention kernels and precision (tests/test_megatron_precision_flags.py). The trainer always runs
    # the attention softmax and the gradient all-reduce in fp32, which is what these two switches ask for.
    "hidden_dropout", "attention_dropout", "attention_backend", "attention_softmax_in_fp32",
    "accumulate_allreduce_grads_in_fp32",
    # sequence parallelism with tensor parallelism (relax.backends.megatron.sequence_parallel;
    # tests/test_megatron_sequence_parallel.py)
    "sequence_parallel",
    # expert parallelism of MoE models (tests/test_megatron_moe.py: EP 2 against EP 1; tests/test_expert_parallel_e2e.py)
    "expert_model_parallel_size",
    # experts split by tensor parallelism (1 or the TP size; tests/test_megatron_etp.py: TP 2 with ETP 2, and with
    # ETP 1 + EP 2, against one rank)
    "expert_tensor_parallel_size",
    # context parallelism of dense models (relax.backends.megatron.context_parallel; tests/test_megatron_context_parallel.py:
    # CP 2 against one rank)
    "context_parallel_size",
    # the key/value exchange of Transformer Engine's CP attention on GPU (cp_comm_type all_gather instead of p2p;
    # tests/test_megatron_context_parallel.py checks the trainer's TransformerConfig); the CPU attention always
    # all-gathers
    "allgather_cp",
    # the warm-up's starting lr (Megatron's OptParamScheduler init_lr; tests/test_megatron_train.py)
    "lr_warmup_init",
    # the MoE router's dtype and token dispatcher (tests/test_megatron_moe_flags.py)
    "moe_router_dtype", "moe_token_dispatcher_type",
    # the optimizer Megatron builds (tests/test_megatron_optimizer_choice.py)
    "optimizer", "sgd_momentum",
    # --qkv-format: a deliberate difference from the reference. The trainer runs attention on right-padded
    # micro-batches in both layouts (relax.backends.megatron.batching.make_micro_batches), so the results are the
    # same; thd allows --use-dynamic-batch-size, bshd refuses it (relax.config.validate.check_batching).
    # tests/test_megatron_flag_triage.py::test_qkv_format_is_accepted_and_bshd_refuses_dynamic_batching
    "qkv_format",
    # --train-backend: megatron is its only choice, and the trainer is Megatron's
    "train_backend",
    # --only-load-weight: forward-only roles (reference, teacher) always load model weights only and build no
    # optimizer (MegatronTrainer.load_weights;
    # tests/test_megatron_flag_triage.py::test_flags_asking_for_what_the_trainer_builds_are_what_it_builds)
    "only_load_weight",
    # LoRA adapters, merged-weight sync (relax.backends.megatron.lora; tests/test_lora*.py); adapter-only sync is
    # refused by relax.config.rules_lora until it is built
    "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_init", "lora_load", "lora_merge_sync",
    "lora_modules_to_save",
})

# Values of flags whose other values are not built yet (merge into relax.config.support.SUPPORTED_VALUES):
TRAINING_SUPPORTED_VALUES: dict[str, frozenset] = {
    "advantage_estimator": frozenset({"reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo",
                                      "on_policy_distillation"}),
    "opd_type": frozenset({"megatron", "sglang"}),  # sglang: tests/test_opd_sglang.py
    "loss_type": frozenset({"custom_loss", "sft"}),
    # the supported model families (relax.formats.model_arch): RMSNorm (LayerNorm in Nemotron) and rotary positions
    "normalization": frozenset({"RMSNorm", "LayerNorm"}),
    "position_embedding_type": frozenset({"rope"}),
    # micro-batches of varying length: only the all-to-all dispatcher (relax.formats.model_arch)
    "moe_token_dispatcher_type": frozenset({"alltoall"}),
    # megatron-core 0.16's get_megatron_optimizer builds adam and sgd; its Muon needs NVIDIA's emerging_optimizers
    # package (not installable here); lion needs a newer Megatron
    "optimizer": frozenset({"adam", "sgd"}),
    # inference_optimized is Megatron's inference-only layer set (relax.config.megatron_options.MODEL)
    "transformer_impl": frozenset({"transformer_engine", "local"}),
}
