"""Rollout-side flags whose features are built (see relax.config.support). Add a dest only with its
code and test."""

ROLLOUT_FEATURES: frozenset[str] = frozenset({
    # hooks with real default implementations (relax.rollout.sglang_rollout, relax.rollout.buffer; the defaults
    # name their old paths relax.engine.rollout.*, read as these by relax.config.hook_paths)
    "data_source_path", "rollout_function_path",
    # over-sampling and filtering
    "over_sampling_batch_size", "dynamic_sampling_filter_path", "buffer_filter_path",
    # evaluation
    "eval_interval", "eval_prompt_data", "eval_config", "skip_eval_before_train", "eval_input_key",
    "eval_label_key", "eval_tool_key", "n_samples_per_eval_prompt", "eval_temperature", "eval_top_p",
    "eval_top_k", "eval_max_response_len", "eval_max_prompt_len", "eval_min_new_tokens", "eval_max_context_len",
    "eval_reward_key", "log_passrate",
    # debug modes
    "save_debug_rollout_data", "load_debug_rollout_data", "load_debug_rollout_data_subsample",
    "debug_rollout_only", "debug_train_only",
    # custom functions
    "custom_generate_function_path", "rollout_data_postprocess_path", "custom_rollout_log_function_path",
    "custom_eval_rollout_log_function_path",
    # partial rollout
    "partial_rollout", "mask_offpolicy_in_partial_rollout", "partial_rollout_max_aborted_count",
    # evaluation generation (tests/test_rollout_flags_logging.py)
    "eval_function_path",
    # step statistics (relax.rollout.step_logs; tests/test_rollout_flags_logging.py)
    "log_multi_turn", "log_correct_samples", "log_reward_category",
    # data
    "skip_bad_lines",
    # multimodal inputs to SGLang (relax.rollout.multimodal; tests/test_rollout_flags_multimodal.py)
    "multimodal_keys",
    # engine fault tolerance: health probes, failover, replacement re-synced to the current weights
    # (relax.rollout.engine_pool; tests/test_engine_fault_tolerance.py, tests/test_engine_pool.py)
    "use_fault_tolerance", "rollout_health_check_interval", "rollout_health_check_timeout",
    "rollout_health_check_first_wait",
    # the liveness watch of engines with requests in flight, on by default (relax.rollout.engine_watch,
    # relax.rollout.liveness; tests/test_engine_liveness.py, tests/test_engine_liveness_e2e.py)
    "engine_liveness_timeout",
    # the autoscaler: scale out and in through the engine pool from the engines' /metrics (relax.rollout.autoscaler,
    # relax.config.autoscaler; tests/test_autoscaler.py)
    "autoscaler_config", "scale_out_timeout", "scale_out_partial_success_policy", "scale_in_drain_timeout",
    "scale_in_shutdown_timeout",
})
