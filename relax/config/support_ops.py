"""Flags of operations and observability (ClearML, notifications, metrics service, timeline, profiling) whose features are built (see relax.config.support). Add a dest only with its code and
test, naming both in a comment beside it."""

OPS_FEATURES: frozenset[str] = frozenset({
    # relax/observability/clearml_sink.py (a MetricsWriter sink; the server/offline check before Ray is
    # require_clearml_target in relax/entrypoints/train.py); tests/test_clearml_offline.py
    "use_clearml",
    # relax/observability/notify.py, sent around run_controller by relax/entrypoints/train.py;
    # tests/test_notify.py and tests/test_clearml_offline.py (e2e)
    "notify_urls",
    # relax/observability/timeline.py: every process's spans, merged by relax/core/controller.py into one Chrome
    # trace; tests/test_timeline.py and tests/test_e2e_grpo.py (the stages of each step nest in it)
    "timeline_dump_dir",
    # relax/observability/profiling.py, used by relax/roles/trainer.py; tests/test_profiling.py (a run's profiles and
    # memray record). --enable-cuda-memory-check is GPU-only (relax.config.support_gpu)
    "use_pytorch_profiler", "profile_step_start", "profile_step_end", "profile_ranks", "profile_target",
    "profile_with_stack", "profile_with_memory", "profile_with_flops", "memory_snapshot_dir",
    "memory_snapshot_num_steps", "memory_recorder",
    # relax/observability/metrics_service.py and metrics_client.py (created by relax/core/controller.py, reported to
    # by relax/roles/trainer.py and relax/roles/rollout.py); tests/test_metrics_service.py (a run scraped as it runs)
    "use_metrics_service",
})
