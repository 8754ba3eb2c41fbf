"""Parse-time rules of --num-iters-per-train-update K (streaming chunks of a step with --fully-async; the loop:
relax.core.streaming). K = 1 is the unchunked step. K > 1: the rollout produces each step in K chunks of
whole prompt groups and the trainer runs its per-sample stages and forward/backward passes on each chunk as it
arrives, with one optimizer step after the last one. What is built is the slice where that is exactly the
unchunked step's update (with a KL loss or reward, the reference role computes each chunk's log-probs before
the trainer takes it); every combination outside it is refused here, naming the flags and why."""

from __future__ import annotations

from typing import Any

from relax.config.errors import ConfigError
from relax.config.facts import samples_per_step

FLAG = "--num-iters-per-train-update"

# flag dest -> why a chunked step cannot honour it exactly (each is refused with K > 1)
WHOLE_STEP_FLAGS = {
    "use_opd": "the teacher's log-probs are computed for a whole step",
    "normalize_advantages": "whitening normalises the advantages over the whole step, not over a chunk",
    "custom_convert_samples_to_train_data_path": "the hook converts a whole step's samples",
    "custom_reward_post_process_path": "the hook post-processes a whole step's rewards",
    "rollout_data_postprocess_path": "the hook post-processes a whole step's samples",
    "load_debug_rollout_data": "replayed rollouts are stored a whole step at a time",
    "over_sampling_batch_size": "each chunk would draw and return prompts against its own target",
    "dynamic_sampling_filter_path": "each chunk would filter against its own target, not the step's",
    "save_debug_train_data": "the dump is written once per step from the whole step's training data",
    "debug_rollout_only": "no training step runs",
    "debug_train_only": "no rollout produces chunks",
}


def check(v: dict[str, Any], dp: int) -> None:
    """After derivation (the global batch size is derived); `dp`: the trainer's data-parallel size."""
    k = v["num_iters_per_train_update"]
    if k is None or k == 1:
        return
    if not v["fully_async"]:
        # the synchronous loop trains a step after its whole rollout: there is nothing to stream into
        raise ConfigError(f"{FLAG} {k} needs --fully-async (the synchronous loop trains a step after its whole "
                          f"rollout); add --fully-async or drop {FLAG}")
    rbs = v["rollout_batch_size"]
    if rbs % k:
        raise ConfigError(f"{FLAG} {k} must divide --rollout-batch-size ({rbs}): each chunk is whole prompt "
                          "groups, so that group-relative advantages are those of the whole step")
    samples = samples_per_step(v)
    if v["global_batch_size"] != samples:
        raise ConfigError(f"{FLAG} {k} needs one optimizer step per rollout step (--num-steps-per-rollout 1, or "
                          f"--global-batch-size {samples} = --rollout-batch-size x --n-samples-per-prompt; now "
                          f"{v['global_batch_size']}): with several, a later global batch's old log-probs would be "
                          "computed after an optimizer step, and the step's chunks are one global batch")
    if v["advantage_estimator"] == "ppo":
        raise ConfigError(f"{FLAG} {k} cannot be combined with --advantage-estimator ppo: the critic computes "
                          "its values and trains on a whole step; use a critic-free estimator or drop " + FLAG)
    for dest, why in WHOLE_STEP_FLAGS.items():
        if dest == "over_sampling_batch_size" and v[dest] in (None, rbs):
            continue  # drawing the step's own batch: each chunk draws its own groups, no more
        if v.get(dest):
            name = "--" + dest.replace("_", "-")
            raise ConfigError(f"{FLAG} {k} cannot be combined with {name}: {why}; drop one of them")
    if samples // k < dp:
        raise ConfigError(f"{FLAG} {k}: a chunk of {samples // k} samples (--rollout-batch-size / {k} x "
                          f"--n-samples-per-prompt) has fewer samples than the {dp} data-parallel trainer ranks; "
                          "each rank needs one of every chunk")
