"""A trainer rank's reference log-probs, one interface whatever `config.reference_placement` says.

The placement is decided once, in validation (relax.config.facts.reference_placement). A trainer rank holds a
`ReferenceSource` when the reference runs in it, and nothing when it is a role of its own or absent:

* `in_rank` (`InRankReference`): a forward-only copy of the actor's model in this rank's process, in the ranks'
  model-parallel groups; its rows are computed when the reference stage runs.
* `child_process` and `streamed` (`ProcessReference`): the one rank's reference in a child process
  (relax.roles.reference_process). When this rank holds every field it reads, the stage only starts the pass,
  which runs on the other core beside the actor's forward stage; the forward stage collects it
  (`forward_done`). With several updates per rollout and no reference rows read before the update, the pass
  comes in parts as the updates need them (relax.roles.step_passes); `streamed` also has the child compute the
  later updates' old-policy rows from a copy of the policy.

The trainer rank asks it the same questions either way: `compute` or `begin` (the stage), `forward_done`,
`passes`, `abandon`, `finish`, `weights_checksum`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch

from relax.backends.megatron.cpu_compat import native_device_ops
from relax.config.facts import REFERENCE_CHILD, REFERENCE_STREAMED
from relax.data.sample import Sample
from relax.observability import timeline
from relax.roles.reference_process import REFERENCE, ReferenceProcess
from relax.roles.step_passes import StepPasses

Rows = list[torch.Tensor]


class ReferenceSource:
    """The reference rows of one trainer rank's steps (see the module docstring)."""

    overlaps = False  # whether `begin` can leave the pass running beside the forward stage

    def compute(self, samples: list[Sample], temperature: float) -> Rows:
        """The reference log-probs of `samples`' responses, now."""
        with native_device_ops():  # plain host tensors: no CUDA-to-CPU rewriting needed (a Python hop per op)
            inputs = [{"tokens": torch.tensor(s.prompt_tokens + s.response_tokens, dtype=torch.long),
                       "response_length": len(s.response_tokens)} for s in samples]
        return self._model().compute_logprobs(inputs, temperature) if inputs else []

    def begin(self, step: int, samples: list[Sample], temperature: float, gbs: int,
              policy: Callable[[], Any]) -> None:
        """Start step `step`'s pass over `samples` beside the forward stage (only when `overlaps`); `policy()`: this
        rank's model tensors, for the old-policy rows of `streamed`."""
        raise NotImplementedError(f"{type(self).__name__} computes its rows when asked (`compute`)")

    def forward_done(self, step: int, forward_start: float, forward_end: float,
                     failing: bool = False) -> tuple[Rows | None, dict[str, float]]:
        """The rows of the pass `begin` left running (None when none runs) and its metrics."""
        return None, {}

    def passes(self, step: int) -> StepPasses | None:
        """Step `step`'s pass in parts, whose rows arrive while the updates run (None when it is not in parts)."""
        return None

    def abandon(self) -> None:
        """Drop a pass in parts of a step that failed before its update."""

    def finish(self, passes: StepPasses) -> dict[str, float]:
        raise NotImplementedError(f"{type(self).__name__} runs no pass in parts")

    def weights_checksum(self) -> float:
        from relax.backends.megatron.model import weights_checksum  # not at the top: see relax.roles.megatron_rank

        return weights_checksum(self._model().gpt_model)

    def _model(self) -> Any:
        raise NotImplementedError


class InRankReference(ReferenceSource):
    """The reference model in this rank's process (`in_rank`)."""

    def __init__(self, model: Any):
        self.model = model  # a forward-only MegatronTrainer (relax.roles.megatron_settings.build_reference_trainer)

    def _model(self) -> Any:
        return self.model


class ProcessReference(ReferenceSource):
    """The one rank's reference in a child process (`child_process`, `streamed`)."""

    overlaps = True

    def __init__(self, config: Any, threads: int):
        # started now, so that its model build overlaps the rank's start-up (the first pass waits); forked, as the
        # rank's constructor runs before its model is built and its process group made (relax.roles.forked_child)
        self.process = ReferenceProcess(config, threads, timeout_s=config.train_step_timeout or None,
                                        with_policy=config.reference_placement == REFERENCE_STREAMED, fork=True)
        self._single: tuple[int, float] | None = None  # (step, start) of a whole pass beside the forward stage
        self._passes: StepPasses | None = None  # the step whose rows arrive in parts
        self.kl_reward = bool(config.kl_coef)  # the advantages read the rows: no parts

    def _model(self) -> Any:
        return self.process

    def begin(self, step: int, samples: list[Sample], temperature: float, gbs: int,
              policy: Callable[[], Any]) -> None:
        """With several updates per rollout and no reference rows read before the update (no --kl-coef), the
        update reads them instead, each update's as it starts, and with `streamed` the later updates' old-policy
        rows come from the child too (relax.roles.step_passes); otherwise one pass, collected by `forward_done`.
        On CPU each pass takes a core (the engines idle while a synchronous step trains); the rows are those of a
        pass run alone."""
        sequences = [s.prompt_tokens + s.response_tokens for s in samples]
        lengths = [len(s.response_tokens) for s in samples]
        if len(samples) // gbs > 1 and not self.kl_reward:
            with_old = self.process.with_policy
            self._passes = StepPasses.start(self.process, step, sequences, lengths, temperature, gbs, with_old,
                                            policy=policy() if with_old else None)
        else:
            self.process.start(sequences, lengths, temperature)
            self._single = (step, time.perf_counter())

    def forward_done(self, step: int, forward_start: float, forward_end: float,
                     failing: bool = False) -> tuple[Rows | None, dict[str, float]]:
        """Wait for the whole pass `begin` started (if any). Metrics: perf/ref_logprob_time (from `begin`
        to the pass's end) and perf/ref_overlap_time (how long the pass and the actor's forward pass ran at once).
        `failing`: the forward stage raised; the pass is waited for and its result or error dropped."""
        if self._single is None:
            return None, {}
        (pass_step, called), self._single = self._single, None
        if failing:
            with contextlib.suppress(BaseException):
                self.process.result()
            return None, {}
        logprobs, start, end = self.process.result()
        to_wall = time.time() - time.perf_counter()  # the child's clock is this one (CLOCK_MONOTONIC)
        timeline.record("reference log-probs (reference process)", start + to_wall, end + to_wall, step=step,
                        cat="train", lane="reference process")
        if pass_step != step:  # a forward stage of another step: never the case in either loop
            raise RuntimeError(f"step {step}: a reference pass of step {pass_step} was still running")
        return logprobs, {"perf/ref_logprob_time": end - called,
                          "perf/ref_overlap_time": max(0.0, min(end, forward_end) - max(start, forward_start))}

    def passes(self, step: int) -> StepPasses | None:
        return self._passes if self._passes is not None and self._passes.step == step else None

    def abandon(self) -> None:
        passes, self._passes = self._passes, None
        if passes is not None:
            passes.abandon()

    def finish(self, passes: StepPasses) -> dict[str, float]:
        """The parts not yet read (those of samples no update trains on), their spans on the timeline, and their
        metrics (`StepPasses.finish`)."""
        metrics = passes.finish()
        self._passes = None
        to_wall = time.time() - time.perf_counter()  # the child's clock is this one (CLOCK_MONOTONIC)
        for kind, start, end in passes.spans:
            name = "reference log-probs" if kind == REFERENCE else "old-policy log-probs"
            timeline.record(f"{name} (reference process)", start + to_wall, end + to_wall, step=passes.step,
                            cat="train", lane="reference process")
        return metrics

    def weights_checksum(self) -> float:
        return self.process.weights_checksum()


def reference_for_rank(config: Any, threads: int) -> ReferenceSource | None:
    """The source a trainer rank starts in its constructor: the child process of `child_process` / `streamed`
    (None otherwise; an `in_rank` reference is built in `setup`, after the ranks' model-parallel groups)."""
    if config.reference_placement in (REFERENCE_CHILD, REFERENCE_STREAMED):
        return ProcessReference(config, threads)
    return None
