"""Where a step's old-policy log-probs come from (the importance ratio's denominator), from the flags and the
number of optimizer steps the step makes. One reading for the trainer's forward stage
(relax.training.step._old_logprobs) and for `--dry-run` (relax.config.explain), which says whether the actor's
forward pass runs at all.

The old policy is the one that generated the samples. Its log-probs are needed when the step makes several
optimizer steps (from the second on the current policy is no longer the old one), for --kl-coef reward shaping,
for on-policy distillation and for --keep-old-actor; with one optimizer step and none of those, the loss uses
the current log-probs (ratio 1) and the trainer skips the pass. --use-rollout-logprobs / --true-on-policy-mode
take the engine's; --true-on-policy-mode and --use-rollout-entropy still run the trainer's pass (to check the
engine's, or for the entropy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OldPolicySource:
    wanted: bool  # the loss or the advantages read old log-probs
    from_engine: bool  # the engine's log-probs are used
    recompute: bool  # the trainer runs its old-policy forward pass

    def describe(self) -> str:
        if not self.recompute:
            return ("the engine's (--use-rollout-logprobs): no actor forward pass" if self.from_engine else
                    "not needed (one optimizer step per rollout, no KL reward, OPD or --keep-old-actor: the loss "
                    "uses the current log-probs, ratio 1): no actor forward pass")
        if self.from_engine:
            return "the engine's; the actor forward pass runs too (to check them, or for --use-rollout-entropy)"
        return "recomputed by the actor forward pass before the first optimizer step"


def old_policy_source(config: Any, num_updates: int) -> OldPolicySource:
    keep_old = bool(config.keep_old_actor)
    from_engine = bool(config.use_rollout_logprobs or config.true_on_policy_mode)
    wanted = num_updates > 1 or bool(config.kl_coef) or bool(config.use_opd) or keep_old
    recompute = bool(config.true_on_policy_mode or config.use_rollout_entropy or (wanted and not from_engine))
    return OldPolicySource(wanted=wanted, from_engine=from_engine, recompute=recompute)
