"""The generative reward model (GenRM, --genrm-model-path): a judge model on engines of its own.

* `relax.config.genrm_options`: --genrm-sampling-config and --genrm-engine-config, checked before Ray.
* `relax.roles.genrm`: the GenRM engines (a second `EnginePool`, behind a router of their own),
  started and stopped by the rollout manager; they never receive the policy's weights.
* `relax.rollout.rewards.genrm`: the judge (template -> request -> parser -> score) the reward runner calls for
  samples whose reward type is `genrm`.
"""
