"""One optimizer step of a `MegatronTrainer` over chunks of the step's samples that arrive one after another
(--num-iters-per-train-update K with --fully-async: the trainer starts on the first chunk of a step while the
rollout still generates the others).

`ChunkedStep(trainer, loss_fn)` zeroes the gradients; `add(samples, last=...)` runs the forward and backward
passes of one chunk (this rank's share of it), accumulating gradients; `finish()` makes the optimizer step
(gradient clipping, the learning-rate schedule's step) once, after the last chunk, and returns the metrics of
`MegatronTrainer.train_step`.

Loss normalisation: `train_step` weights each micro-batch's loss by its share of the step (its masked tokens,
or samples, over the step's, `step_shares`). The step's totals are known only when its last chunk has
arrived, so each micro-batch's loss is weighted here by its own count instead (an unnormalised sum), the
counts of every chunk (over all data-parallel ranks) are added up, and the accumulated gradients and metric
sums are divided by the step's total before the optimizer step: the same objective, gradient and `loss`
metric as one `train_step` over the whole step, up to float32 round-off (the order of the sums differs).
A step with no masked token trains nothing either way (every loss term is masked).

Data-parallel gradient reduction (and what Megatron's `finalize_model_grads` adds: sequence-parallel layer
norms, tied embeddings across pipeline ends) runs once, on the last chunk, over the accumulated gradients:
earlier chunks run under the DDP wrapper's `no_sync` with the finalize hook off, as the micro-batches before
the last one of a `train_step` do.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from relax.backends.megatron.cpu_compat import apply_cpu_compat
from relax.backends.megatron.trainer import MegatronTrainer, _mask_counts

__all__ = ["ChunkedStep"]


class ChunkedStep:
    """One optimizer step of `trainer` over chunks (see the module docstring). Collective like `train_step`:
    every rank constructs it and calls `add` for the same chunks (each with its own share) and `finish`."""

    def __init__(self, trainer: MegatronTrainer, loss_fn: Any, temperature: float = 1.0, *,
                 with_entropy: Optional[bool] = None):
        apply_cpu_compat()
        if trainer.optimizer is None:
            raise RuntimeError("this MegatronTrainer is forward-only")
        self.trainer, self.loss_fn, self.temperature = trainer, loss_fn, temperature
        self.with_entropy = bool(getattr(loss_fn, "needs_entropy", False)) if with_entropy is None else with_entropy
        self.loss_weighting = getattr(loss_fn, "loss_weighting", "samples")
        if self.loss_weighting not in ("tokens", "samples"):
            raise ValueError(f"loss_fn.loss_weighting must be 'tokens' or 'samples', not {self.loss_weighting!r}")
        self.totals = [0.0, 0.0, 0.0]  # masked tokens, samples with one, micro-batches: all chunks, all DP ranks
        self.sums: dict[str, float] = {}  # count-weighted metric sums of all chunks (all DP ranks)
        self.chunks = 0
        self.finished = False
        trainer.model.train()
        trainer.model.zero_grad_buffer()
        trainer.optimizer.zero_grad()

    def add(self, samples: Sequence[dict[str, Any]], *, last: bool) -> None:
        """Forward and backward passes of this rank's share of one chunk, gradients accumulated. `last`: the
        step's last chunk (the gradients are reduced over the data-parallel ranks after it)."""
        from megatron.core import parallel_state as ps

        t = self.trainer
        if self.finished:
            raise RuntimeError("this chunked step has made its optimizer step already")
        if not samples:
            raise RuntimeError("a chunk of the step has no sample for this data-parallel rank (a chunk needs at "
                               "least as many samples as there are data-parallel ranks)")
        t.model.train()  # a forward-only pass between chunks (the next chunk's old log-probs) may have left eval
        micro_batches = t._micro_batches(samples, t.settings.max_tokens_per_micro_batch)
        dp_group = ps.get_data_parallel_group()
        counts = torch.tensor(_mask_counts([mb.mask for mb in micro_batches]), dtype=torch.float64,
                              device=t._device)
        if dist.get_world_size(dp_group) > 1:
            dist.all_reduce(counts, group=dp_group)
        self.totals = [a + b for a, b in zip(self.totals, counts.cpu().tolist())]
        weights = {id(mb): dict(zip(("tokens", "samples"), _mask_counts([mb.mask])[:2])) for mb in micro_batches}
        metric_weighting = getattr(self.loss_fn, "metric_weighting", None)
        # as in train_step: undo the schedule's division by the local micro-batch count and DDP's average over DP
        undo = len(micro_batches) * t.layout.dp

        def micro_batch_loss(mb, logits: torch.Tensor):
            if t.settings.value_head:
                logprobs, entropy = t._response_values(logits, mb), None
            else:
                logprobs, entropy = t._response_logprobs(logits, mb, self.temperature, self.with_entropy)
            return self.loss_fn(logprobs, entropy, mb.fields, mb.mask)

        def step(mb, logits: torch.Tensor):
            if t.settings.recompute_loss_function and logits.requires_grad:
                loss, metrics = checkpoint(micro_batch_loss, mb, logits, use_reentrant=False)
            else:
                loss, metrics = micro_batch_loss(mb, logits)
            weight = weights[id(mb)]
            report = {"loss": loss.detach().double() * weight[self.loss_weighting]}
            for key, value in metrics.items():
                weighting = metric_weighting(key) if metric_weighting is not None else self.loss_weighting
                report[key] = torch.as_tensor(value).detach().to(t._device, torch.float64) * weight[weighting]
            return loss * (weight[self.loss_weighting] * undo), report

        finalize = t.config.finalize_model_grads_func
        with t._route_replayer(samples) as replayer:
            if last:
                outputs = t._run(micro_batches, step, forward_only=False, hooks=replayer)
            else:
                t.config.finalize_model_grads_func = None  # the gradients are reduced once, after the last chunk
                try:
                    with t.model.no_sync():
                        outputs = t._run(micro_batches, step, forward_only=False, hooks=replayer)
                finally:
                    t.config.finalize_model_grads_func = finalize
        for key, value in t._reduce_metrics(outputs, dp_group).items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.chunks += 1

    def finish(self) -> dict[str, float]:
        """Normalise the accumulated gradients and metrics by the step's totals and make the optimizer step.
        Returns `train_step`'s metrics (`loss`, `grad_norm`, `lr`, `skipped`, `loss_scale`, the loss's own)."""
        t = self.trainer
        if self.finished or not self.chunks:
            raise RuntimeError("finish() needs at least one chunk added, and runs once")
        self.finished = True
        tokens, samples, _ = self.totals
        metric_weighting = getattr(self.loss_fn, "metric_weighting", None)
        divisor = {"tokens": tokens if tokens > 0 else 1.0, "samples": samples if samples > 0 else 1.0}
        t.model.scale_gradients(1.0 / divisor[self.loss_weighting])
        metrics = {}
        for key, value in self.sums.items():
            weighting = self.loss_weighting if key == "loss" or metric_weighting is None else metric_weighting(key)
            metrics[key] = value / divisor[weighting]
        return t._optimizer_step(metrics)
