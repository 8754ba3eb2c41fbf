"""Flags of the HealthManager (--use-health-check) whose features are built (see relax.config.support). Add a dest
only with its code and test, naming both in a comment beside it."""

HEALTH_FEATURES: frozenset[str] = frozenset({
    # heartbeats of every Megatron rank and of the rollout manager (relax/core/health.py: start_heartbeat from
    # relax/roles/megatron_rank.py and relax/roles/rollout.py, HeartbeatBoard, HealthManager.watch through
    # relax/core/calls.py set_watch; tests/test_health_rollout.py: a hung, then killed, rollout manager found by
    # name within --heartbeat-timeout) and the restart of the run from
    # its last checkpoint (relax/core/health_restart.py, the loop in relax/core/controller.py run_controller):
    # tests/test_health.py (heartbeat timeout, process state, restart bookkeeping, metrics truncation, fault
    # parsing) and tests/test_health_e2e.py (a killed trainer rank restarted from a checkpoint; a hung one past
    # --max-global-restart)
    "use_health_check",
    # the restart limit (relax/core/health_restart.py RestartLedger): tests/test_health.py
    # test_ledger_gives_up_naming_counts, tests/test_health_e2e.py test_hung_rank_past_max_global_restart
    "max_global_restart",
    # Relax's own heartbeat period and timeout (relax/core/health.py): tests/test_health.py test_silent_after_timeout,
    # tests/test_health_e2e.py (a SIGSTOPped rank found within --heartbeat-timeout); their values and combinations
    # are checked before Ray (relax/config/rules_training.py check_health): tests/test_health.py
    # test_bad_health_settings_fail_at_parse, test_health_flags_need_use_health_check
    "heartbeat_interval", "heartbeat_timeout",
})
