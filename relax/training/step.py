"""One rollout step of the actor on one rank: samples (+ auxiliary inputs) -> optimizer updates -> metrics.

Plain code on a `MegatronTrainer` (no Ray), called by `relax.roles.trainer.TrainerWorker.train`.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch

from relax.data.sample import Sample


def needs_reference(config: Any) -> bool:
    """A reference model is needed for the KL loss term or KL reward shaping."""
    return bool(config.use_kl_loss) or bool(config.kl_coef)


def _check_extras(samples: Sequence[Sample], extras: dict[str, Any], step: int) -> None:
    ref = extras.get("ref_logprobs")
    if ref is None:
        return
    if len(ref) != len(samples):
        raise RuntimeError(f"step {step}: {len(ref)} reference log-prob rows for {len(samples)} samples")
    index = extras.get("ref_sample_index")
    if index is not None and list(index) != [s.index for s in samples]:
        raise RuntimeError(f"step {step}: reference log-probs were computed for other samples")
    for row, s in zip(ref, samples):
        if len(row) != len(s.response_tokens):
            raise RuntimeError(f"step {step}: sample {s.index} has {len(s.response_tokens)} response tokens, "
                               f"reference log-probs {len(row)}")


def train_rollout(trainer, samples: Sequence[Sample], config: Any, extras: dict[str, Any] | None = None,
                  step: int = 0) -> dict[str, float]:
    """Advantages, old/reference log-probs, then `num_updates` optimizer steps on this rank's share."""
    from relax.training.advantages import compute_advantages, trainer_inputs
    from relax.training.objective import PolicyObjective

    t0 = time.perf_counter()
    extras = extras or {}
    if not samples:
        raise RuntimeError(f"step {step}: no samples in the data plane")
    _check_extras(samples, extras, step)
    objective = PolicyObjective.from_config(config)
    ref_rows = extras.get("ref_logprobs")
    if (objective.needs_ref or config.kl_coef) and ref_rows is None:
        raise RuntimeError(f"step {step}: --use-kl-loss / --kl-coef need reference log-probs, but no reference "
                           "role sent them")
    ref = [torch.tensor(r, dtype=torch.float32) for r in ref_rows] if ref_rows is not None else None
    layout = trainer.layout
    temperature = config.rollout_temperature
    gbs = config.global_batch_size or len(samples)
    num_updates = max(1, len(samples) // gbs)
    base = trainer_inputs(samples, [0.0] * len(samples))
    olds = None
    if config.use_rollout_logprobs:
        olds = [x["rollout_logprobs"] for x in base]
    elif num_updates > 1 or config.kl_coef:
        olds = trainer.compute_logprobs(base, temperature)
    advantages, adv_metrics = compute_advantages(samples, config, old_logprobs=olds, ref_logprobs=ref)
    inputs = trainer_inputs(samples, advantages)
    for i, x in enumerate(inputs):
        if olds is not None:
            x["old_logprobs"] = olds[i]
        if ref is not None:
            x["ref_logprobs"] = ref[i]
    metrics: dict[str, list[float]] = {}
    for update in range(num_updates):
        batch = inputs[update * gbs:(update + 1) * gbs]
        mine = batch[layout.dp_rank::layout.dp]
        try:
            out = trainer.train_step(mine, objective, temperature)
        except FloatingPointError as exc:
            raise FloatingPointError(f"step {step} (update {update}): {exc}") from None
        for key in ("loss", "grad_norm"):
            if not math.isfinite(out.get(key, 0.0)):
                raise FloatingPointError(f"step {step} (update {update}): train/{key} is {out[key]}; "
                                         "the update was not applied")
        for key, value in out.items():
            metrics.setdefault(key, []).append(value)
    if config.reset_optimizer_states:
        trainer.reset_optimizer_states()
    result = {f"train/{k}": sum(v) / len(v) for k, v in metrics.items()}
    for key, value in adv_metrics.items():
        result[f"train/{key}"] = value
    if "train/kl" not in result and "train/kl_reward" in result:
        result["train/kl"] = result["train/kl_reward"]
    if "ref_seconds" in extras:
        result["perf/ref_logprob_time"] = float(extras["ref_seconds"])
    result["train/num_updates"] = float(num_updates)
    result["train/tokens"] = float(sum(len(x["tokens"]) for x in inputs))
    result["perf/train_compute_time"] = time.perf_counter() - t0
    return result
