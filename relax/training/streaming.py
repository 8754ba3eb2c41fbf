"""The actor's stages of one step over streaming chunks on one rank (--num-iters-per-train-update K with
--fully-async; no Ray): for each chunk of whole prompt groups as it arrives, the per-sample stages of
`relax.training.step` (training data and old log-probs, advantages) and the forward and backward passes of
this rank's share, gradients accumulated (`relax.backends.megatron.accumulate.ChunkedStep`); after the last
chunk, one optimizer step. Config validation (relax.config.rules_streaming) admits only runs where this is
the unchunked step's update: one global batch per step, advantages that are per sample or per group, no
critic or teacher role, no hook that sees a whole step. With a KL loss or reward the reference role has
written each chunk's `ref_logprobs` before the chunk arrives here (relax.core.streaming).

Metrics: those of `update_stage` for the whole step (`train/loss`, `train/grad_norm`, ... of the one optimizer
step; `samples/trained`, `train/tokens` summed over the chunks; the advantage stage's and the
data-parallel spread metrics averaged over the chunks, weighted by their samples) and `train/num_chunks`.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch

from relax.config.facts import needs_reference
from relax.data.sample import Sample
from relax.training.objective import PolicyObjective
from relax.training.step import (actor_updates_at, advantage_stage, check_rows, dp_share, forward_stage,
                                 update_inputs)


class StreamingUpdate:
    """One step's update over chunks on one rank: `add(samples, last=...)` per chunk, in order; the last
    chunk's call makes the optimizer step and returns the step's metrics (None before)."""

    def __init__(self, trainer: Any, config: Any, step: int):
        self.trainer, self.config, self.step = trainer, config, step
        self.update_actor = actor_updates_at(config, step)
        objective = PolicyObjective.from_config(config)
        # not at the top: it loads Megatron-core, and the driver imports this module (relax.roles.megatron_rank)
        from relax.backends.megatron.accumulate import ChunkedStep

        self.accumulated = ChunkedStep(trainer, objective, config.rollout_temperature) if self.update_actor else None
        self.chunks = 0
        self.received = 0
        self.tokens = 0.0
        self.raw_rewards: list[float] = []
        self.rewards: list[float] = []
        self.custom_data = False
        self.weighted: dict[str, float] = {}  # sample-weighted sums of per-chunk metrics
        self.on_policy_diff: float | None = None
        self.seconds = 0.0

    def add(self, samples: Sequence[Sample], *, last: bool) -> dict[str, float] | None:
        """`samples`: the chunk's, with `ref_logprobs` when the run needs a reference (relax.config.facts)."""
        t0 = time.perf_counter()
        if self.accumulated is not None and self.accumulated.finished:
            raise RuntimeError(f"step {self.step}: a chunk after the step's last one")
        batch, olds = forward_stage(self.trainer, samples, self.config, self.step)
        refs = None
        if needs_reference(self.config):  # aligned with the samples the batch trains
            by_index = {s.index: s.ref_logprobs for s in samples}
            rows = [by_index[s.index] for s in batch.samples]
            check_rows(batch.samples, rows, "ref_logprobs", self.step)
            refs = [torch.tensor(r, dtype=torch.float32) for r in rows]
        advantages, _, adv_metrics = advantage_stage(batch, self.config, old_logprobs=olds, ref_logprobs=refs)
        inputs = update_inputs(batch, advantages, olds, refs)
        mine, spread = dp_share(inputs, self.trainer.layout, bool(self.config.balance_data))
        if self.accumulated is not None:
            self.accumulated.add(mine, last=last)
        n = float(len(samples))
        for key, value in {**adv_metrics, **{f"train/{k}": v for k, v in spread.items()}}.items():
            self.weighted[key] = self.weighted.get(key, 0.0) + value * n
        self.chunks += 1
        self.received += batch.received
        self.tokens += float(sum(len(x["tokens"]) for x in inputs))
        self.custom_data = self.custom_data or batch.custom_data
        self.raw_rewards += [float(r) for r in batch.raw_rewards]
        if batch.rewards is not None:
            self.rewards += [float(r) for r in batch.rewards]
        if batch.on_policy_diff is not None:
            self.on_policy_diff = max(self.on_policy_diff or 0.0, batch.on_policy_diff)
        self.seconds += time.perf_counter() - t0
        return self._finish() if last else None

    def _finish(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        result: dict[str, Any] = {}
        if self.accumulated is not None:
            out = self.accumulated.finish()
            for key in ("loss", "grad_norm"):
                if not math.isfinite(out.get(key, 0.0)):
                    raise FloatingPointError(f"step {self.step}: train/{key} is {out[key]}; the update was not "
                                             "applied")
            result.update({f"train/{k}": v for k, v in out.items()})
            if self.config.reset_optimizer_states:
                self.trainer.reset_optimizer_states()
        samples = float(max(1, self.received))
        result.update({k: v / samples for k, v in self.weighted.items()})
        result["train/num_updates"] = 1.0 if self.update_actor else 0.0
        result["train/num_chunks"] = float(self.chunks)
        result["samples/trained"] = float(self.received if self.update_actor else 0)
        if self.custom_data:
            result["train/raw_reward_mean"] = sum(self.raw_rewards) / max(1, len(self.raw_rewards))
            if self.rewards:
                result["train/reward_mean"] = sum(self.rewards) / len(self.rewards)
        if self.on_policy_diff is not None:
            result["train/true_on_policy_max_abs_diff"] = self.on_policy_diff
        result["train/tokens"] = self.tokens
        result["perf/train_compute_time"] = self.seconds + time.perf_counter() - t0
        return result
