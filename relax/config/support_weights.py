"""Checkpoint and weight-sync flags whose features are built (see relax.config.support). Add a dest only with
its code and test.

- relax/core/checkpointing.py: tests/test_ckpt_save_load.py (crash mid-save, --no-save-optim /
  --no-load-optim, --async-save + --rotate-ckpt / --max-actor-ckpt-to-keep, --save-hf) and
  tests/test_ckpt_resume_e2e.py (exact resume through the controller).
- relax/weights/sync.py: tests/test_weightsync_paths.py (tensor, disk and distributed paths, exhaustive check).
"""

WEIGHTS_FEATURES: frozenset[str] = frozenset({
    "no_save_optim", "no_load_optim", "max_actor_ckpt_to_keep", "rotate_ckpt", "save_hf", "async_save",
})

# Built and tested in relax.weights.sync (`push_for_config` reads it), but the controller's push goes
# through TrainerWorker.push_weights, which must call `push_for_config(named, urls, version, self.config)`
# (a one-line change in relax/roles/trainer.py) before this flag takes effect in a run:
WEIGHTS_FEATURES_AFTER_TRAINER_PATCH: frozenset[str] = frozenset({"check_weight_update_equal"})

# Helper C: colocate/offload (relax/core/colocate.py, relax/backends/megatron/offload.py, tests/test_colocate*.py)
# and --balance-data (relax/data/balance.py, tests/test_balance_data.py).
COLOCATE_FEATURES: frozenset[str] = frozenset({
    "colocate", "offload", "offload_train", "offload_rollout", "balance_data",
})
WEIGHTS_FEATURES = WEIGHTS_FEATURES | COLOCATE_FEATURES
