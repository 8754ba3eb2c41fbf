"""Compatibility package: the stable dotted paths users put in launch scripts and that flag defaults name.

Pure re-exports; the code lives in its real package:

    relax.engine.rollout.sglang_rollout.generate_rollout            -> relax.rollout.sglang_rollout
    relax.engine.rollout.data_source.RolloutDataSourceWithBuffer    -> relax.rollout.buffer
    relax.engine.filters.dynamic_sampling_filters.check_reward_nonzero_std -> relax.rollout.filters

Add a path here only when a script or a flag default names it; new code imports the real module.
"""
