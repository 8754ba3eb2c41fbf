"""Flags of fully-async mode and its stages (relax/core/stages.py and the async loops) whose features are built (see relax.config.support). Add a dest only with its code and
test, naming both in a comment beside it."""

ASYNC_FEATURES: frozenset[str] = frozenset({
    # The bounded-staleness loop: rollout up to --max-staleness steps ahead of training, over the same stages,
    # weights pushed with the engines paused in place; checkpoints hold the saved step's rollout position.
    # relax/core/async_loop.py; tests/test_async_window.py (the schedule, random delays) and
    # tests/test_fully_async_e2e.py (S=0 equals sync, S=1 overlap/staleness/each index once, resume).
    "fully_async", "max_staleness",
    # Streaming chunks of a step: relax/core/streaming.py, relax/training/streaming.py,
    # relax/backends/megatron/accumulate.py (rules: relax/config/rules_streaming.py); tests/test_chunked_step.py
    # (chunks give the whole step's update), tests/test_fully_async_config.py and tests/test_fully_async_e2e.py
    # (K=2 equals K=1, each index once, training started before the rollout ended).
    "num_iters_per_train_update",
})
