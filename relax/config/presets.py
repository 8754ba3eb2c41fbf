"""The embedded default: what `relax-train` runs when no model and no data are given.

It trains a tiny model, built locally, on a small synthetic task with an exact-match reward (see
`relax.models.tasks`). Preset values only fill flags the user did not set; the model and the data are
created in `<output-dir>/embedded/` by the controller before any role starts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from relax.config.facts import samples_per_step

EMBEDDED_MARKER = "embedded_default"

# Tuned for the tiny model on the `successor` task (see relax.models.tasks.TINY_GRPO_RECOMMENDED):
# 4 optimizer steps per rollout, a warm-up of 5 rollouts and a cosine decay to 1/10 of the peak rate.
# Robustness (issue 18): at lr 2e-3 one Adam step moves every weight of this 64-wide model by ~10% of its
# scale (init std ~0.02), i.e. a logit by ~0.1-0.5 nat, so a rollout's 4 steps can move the policy by ~1 nat;
# with --kl-loss-coef 0.01 seed 4321 collapsed after one such rollout (step 4: approx_kl 0.81, then every
# answer the bare stop token, reward 0, zero gradient for 25 steps). Two guards bound such a move:
# * dual-clip PPO (--eps-clip-c 3): a negative-advantage token whose ratio grew past 3 within a rollout gives
#   no gradient; before, its loss -A*ratio grew without bound (a grad-norm spike of 15x the usual, 6.7 vs 0.45,
#   seen at step 6 of seed 4321);
# * --kl-loss-coef 0.1 (was 0.01): the KL to the warm start pulls a drifting answer back within a few steps
#   (at 0.01 it was ~100x weaker than the policy-gradient term).
# * --entropy-coef 0.01: without it a seed could end deterministic on a wrong or empty answer for some
#   prompts (seed 1234: entropy 0.007, every group zero-variance, reward 0.69 at step 99 after 0.98 at step
#   33); the KL term cannot pull such a policy back, its sampled-token gradient vanishes once p ~ 1. With it
#   the same seed ends at 0.84-0.96 (benchmarks/seed_sweep.py; docs/benchmarks.md, "Learning: seed sweep of
#   the main job").
# One micro-batch per optimizer step (128 samples): the per-token mean is then over the whole step whatever
# the trainer's micro-batch weighting, and the update pass is ~2x faster than 8 micro-batches of 16.
# Measured spread over seeds: docs/benchmarks.md ("Learning: seed sweep of the main job"), benchmarks/seed_sweep.py.
EMBEDDED_PRESET: dict[str, Any] = {
    "rollout_batch_size": 32,
    "n_samples_per_prompt": 16,
    "num_rollout": 100,
    "num_steps_per_rollout": 4,
    "rollout_max_response_len": 8,
    "rollout_temperature": 1.0,
    "rm_type": "exact_match",
    "input_key": "input",
    "label_key": "label",
    "apply_chat_template": True,
    "lr": 2e-3,
    "lr_warmup_iters": 20,
    "lr_decay_style": "cosine",  # decays over --num-rollout x steps per rollout (derived --lr-decay-iters)
    "min_lr": 2e-4,
    "weight_decay": 0.0,
    "clip_grad": 1.0,
    "eps_clip_c": 3.0,
    "use_kl_loss": True,
    "kl_loss_coef": 0.1,
    "kl_loss_type": "low_var_kl",
    "entropy_coef": 0.01,
    "calculate_per_token_loss": True,
    "micro_batch_size": 128,
    "rollout_shuffle": True,
    "resource": {"actor": [1, 1], "rollout": [1, 1]},
    "distributed_backend": "gloo",
}

# How `--help` states a preset value that apply_embedded_default adjusts, or sets outside the table above.
PRESET_NOTES: dict[str, str] = {
    "hf_checkpoint": "a tiny model built in <output-dir>/embedded/model",
    "prompt_data": "a synthetic task written to <output-dir>/embedded/train.jsonl",
    "micro_batch_size": f"{EMBEDDED_PRESET['micro_batch_size']}, or the largest divisor of the samples per "
                        "optimizer step below it",
    "num_steps_per_rollout": f"{EMBEDDED_PRESET['num_steps_per_rollout']}, unless --global-batch-size is set "
                             "or it does not divide the samples per rollout",
}


def is_embedded_default(values: dict[str, Any], explicit: frozenset[str]) -> bool:
    """No model and no prompt data given (and not a train-only debug run).

    A resolved config written by --dry-run names the embedded paths explicitly; that still counts.
    """
    if values.get("load_debug_rollout_data") or values.get("debug_train_only"):
        return False
    given = (values.get("hf_checkpoint"), values.get("prompt_data"))
    return given == (None, None) or given == embedded_paths(values["output_dir"])


def embedded_paths(output_dir: str) -> tuple[str, str]:
    base = Path(output_dir) / "embedded"
    return str(base / "model"), str(base / "train.jsonl")


def apply_embedded_default(values: dict[str, Any], explicit: frozenset[str]) -> bool:
    if not is_embedded_default(values, explicit):
        return False
    model_dir, data_path = embedded_paths(values["output_dir"])
    values["hf_checkpoint"] = model_dir
    values["prompt_data"] = data_path
    for key, val in EMBEDDED_PRESET.items():
        if key in values and key not in explicit:
            values[key] = val
    # Keep the preset's batch shape consistent when the user changed the batch flags.
    samples = samples_per_step(values)
    steps = values.get("num_steps_per_rollout")
    if "num_steps_per_rollout" not in explicit and "global_batch_size" in explicit:
        values["num_steps_per_rollout"] = steps = None  # the user's global batch decides
    if "num_steps_per_rollout" not in explicit and steps and samples % steps:
        values["num_steps_per_rollout"] = steps = None  # one optimizer step per rollout
    per_update = samples // steps if steps else (values.get("global_batch_size") or samples)
    if "micro_batch_size" not in explicit:
        values["micro_batch_size"] = math.gcd(EMBEDDED_PRESET["micro_batch_size"], per_update)
    return True
