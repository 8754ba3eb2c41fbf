"""Training-side flags whose features are built (see relax.config.support). Add a dest only with its
code and test."""

TRAINING_FEATURES: frozenset[str] = frozenset({
    # reference role and KL (tests/test_training_*.py, tests/test_training_e2e.py)
    "use_kl_loss", "kl_loss_coef", "kl_loss_type", "use_unbiased_kl", "kl_coef", "ref_load", "ref_ckpt_step",
    "ref_update_interval", "gamma",
    # off-policy corrections and loss hooks
    "use_tis", "tis_clip", "tis_clip_low", "use_opsm", "opsm_delta", "get_mismatch_metrics",
    "custom_tis_function_path", "custom_pg_loss_reducer_function_path", "custom_loss_function_path",
    # trainer options
    "only_train_params_name_list", "freeze_params_name_list", "reset_optimizer_states",
    "use_dynamic_batch_size", "max_tokens_per_gpu", "log_probs_max_tokens_per_gpu",
})

# Values of flags whose other values are not built yet (merge into relax.config.support.SUPPORTED_VALUES):
TRAINING_SUPPORTED_VALUES: dict[str, frozenset] = {
    "advantage_estimator": frozenset({"reinforce_plus_plus", "reinforce_plus_plus_baseline"}),
    "loss_type": frozenset({"custom_loss", "sft"}),
}
