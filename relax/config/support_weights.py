"""Checkpoint, weight-sync and colocation flags whose features are built (see relax.config.support). Add a
dest only with its code and test.

- relax/core/checkpointing.py: tests/test_ckpt_save_load.py (crash mid-save, --no-save-optim /
  --no-load-optim, --async-save + --rotate-ckpt / --max-actor-ckpt-to-keep, --save-hf) and
  tests/test_ckpt_resume_e2e.py (exact resume through the controller).
- relax/weights/sync.py: tests/test_weightsync_paths.py (tensor, disk and distributed paths, exhaustive check);
  every push of a run goes through its `push_for_config`, which reads these flags.
- colocate/offload: relax/core/colocate.py, relax/backends/megatron/offload.py, tests/test_colocate*.py;
  --balance-data: relax/data/balance.py, tests/test_balance_data.py.
"""

CHECKPOINT_FEATURES: frozenset[str] = frozenset({
    "no_save_optim", "no_load_optim", "max_actor_ckpt_to_keep", "rotate_ckpt", "save_hf", "async_save",
})
WEIGHT_SYNC_FEATURES: frozenset[str] = frozenset({"weight_sync_method", "check_weight_update_equal"})
COLOCATE_FEATURES: frozenset[str] = frozenset({
    "colocate", "offload", "offload_train", "offload_rollout", "balance_data",
})
WEIGHTS_FEATURES: frozenset[str] = CHECKPOINT_FEATURES | WEIGHT_SYNC_FEATURES | COLOCATE_FEATURES
