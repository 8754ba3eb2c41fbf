"""The stages of one training step after its rollout, as the controller calls them (in order, in sync mode).

Each stage is a role's method that reads its inputs from the step's data-plane partition and writes its
per-sample outputs back as stage fields (relax.data.sample.STAGE_FIELDS); what comes back to the driver is
metrics only:

    rollout              rollout manager   tokens, masks, rewards, weight version, routes   (the controller's)
    reference_logprobs   reference group   ref_logprobs  (actor ranks: AuxRoles.reference_in_trainer; there
                                           the pass runs beside actor_forward, which waits for it)
    teacher_logprobs     teacher group     teacher_logprobs  (or the --opd-type sglang server)
    critic_values        critic group      values
    actor_forward        actor ranks       old_logprobs (when the loss needs them)
    advantages           actor rank 0      advantages, returns (ppo)
    actor_update         actor ranks       (the update; metrics)
    reference_refresh    actor ranks       (--ref-update-interval: the actor's weights into the reference)
    critic_update        critic group      (the update from values and returns; metrics)
    weight push          actor ranks       (the controller's, with colocation)

A stage whose role the run does not have returns no metrics and calls nothing. `Stages` binds the stages to
the run's roles and to the controller's bounded calls (relax.core.deadlines): `trainers(method, action, step,
*args)` calls every actor rank, `trainer0(...)` rank 0 alone, `bounded(names, action, step, fn)` a driver-side
call of auxiliary roles; each within --train-step-timeout.

`Stages.plan()` is the list both loops run (the synchronous controller and the fully-async training thread):
groups in order, where the stages of one group read only the rollout's fields and write different ones, so
`run_group` runs them at the same time, each on its own role's processes (the reference, teacher and critic
passes beside the actor's forward pass). The order of the groups is the data flow: advantages need every
log-prob and value, the update needs the advantages.
"""

from __future__ import annotations

from typing import Any, Callable

from relax.core.calls import start_bounded
from relax.core.deadlines import Call
from relax.core.roles import AuxRoles
from relax.observability import timeline

Stage = Callable[[int], dict[str, float]]


class Stages:
    def __init__(self, config: Any, aux: AuxRoles, *, trainers: Callable[..., list[Any]],
                 trainer0: Callable[..., Any], bounded: Callable[..., Any]):
        self.config = config
        self.aux = aux
        self._trainers = trainers
        self._trainer0 = trainer0
        self._bounded = bounded

    def plan(self, without: tuple[Stage, ...] = ()) -> tuple[tuple[Stage, ...], ...]:
        """The stages after the rollout, as groups run in order (`run_group`), less `without` (the fully-async
        loop's `ahead()` stages, already run). Stages whose role the run does not have are left out of the
        first group (they would call nothing). The in-trainer reference comes alone before it: it only starts
        its pass on the actor's ranks (which run it beside the forward pass), and those ranks must receive the
        forward call after it."""
        aux = self.aux
        fields: tuple[Stage, ...] = tuple(
            stage for stage, present in ((self.reference_logprobs, aux.reference is not None),
                                         (self.teacher_logprobs, aux.teacher is not None),
                                         (self.critic_values, aux.critic is not None),
                                         (self.actor_forward, True)) if present and stage not in without)
        head = ((self.reference_logprobs,), fields) if aux.reference_in_trainer else (fields,)
        return (*head, (self.advantages,), (self.actor_update,), (self.reference_refresh,), (self.critic_update,))

    def ahead(self) -> tuple[Stage, ...]:
        """The stages the fully-async loop runs for a step as soon as its rollout is stored, while earlier steps
        still train: the passes of frozen models in roles of their own, which read only the rollout's fields.
        The reference (unless --ref-update-interval refreshes it from the actor, so that step N+1's pass must
        follow step N's refresh) and the teacher. The critic's values need the critic updated by the step
        before, and the in-trainer reference runs on the actor's ranks: both stay with the training stages."""
        aux = self.aux
        return tuple(stage for stage, present in (
            (self.reference_logprobs, aux.reference is not None and not self.config.ref_update_interval),
            (self.teacher_logprobs, aux.teacher is not None)) if present)

    def _group(self, name: str, action: str, step: int, fn: Callable[[], Any]) -> Any:
        return self._bounded(name, action, step, fn)

    # ------------------------------------------------------------------ other roles' rows
    def reference_logprobs(self, step: int) -> dict[str, float]:
        ref = self.aux.reference
        if ref is None:
            if not self.aux.reference_in_trainer:
                return {}
            parts = self._trainers("reference_logprobs", "reference log-probs", step, step)
            if any(p.get("overlapped") for p in parts):  # runs beside actor_forward, which reports its time
                return {}
            return {"perf/ref_logprob_time": max(p["seconds"] for p in parts)}
        return {"perf/ref_logprob_time": self._group("reference", "reference log-probs", step,
                                                     lambda: ref.compute(step))}

    def reference_chunk(self, step: int, indexes: list[int]) -> dict[str, float]:
        """The reference log-probs of one streamed chunk of step `step` (--num-iters-per-train-update), before the
        actor trains on it; the reference is a role of its own in fully-async runs."""
        ref = self.aux.reference
        if ref is None:
            return {}
        return {"perf/ref_logprob_time": self._group("reference", "reference log-probs of a chunk", step,
                                                     lambda: ref.compute(step, indexes))}

    def teacher_logprobs(self, step: int) -> dict[str, float]:
        teacher = self.aux.teacher
        if teacher is None:
            return {}
        return {"perf/teacher_logprob_time": self._group("teacher", "teacher log-probs", step,
                                                         lambda: teacher.compute(step))}

    def critic_values(self, step: int) -> dict[str, float]:
        critic = self.aux.critic
        if critic is None:
            return {}
        return {"perf/critic_value_time": self._group("critic", "critic values", step, lambda: critic.compute(step))}

    # ------------------------------------------------------------------ the actor
    def actor_forward(self, step: int) -> dict[str, float]:
        return self._trainers("forward", "old log-probs", step, step)[0]

    def advantages(self, step: int) -> dict[str, float]:
        return self._trainer0("advantages", "advantages", step, step)

    def actor_update(self, step: int) -> dict[str, float]:
        return self._trainers("train", "train step", step, step)[0]

    def reference_refresh(self, step: int) -> dict[str, float]:
        """--ref-update-interval N: after every N-th step's update the reference takes the actor's weights."""
        interval = self.config.ref_update_interval
        if self.aux.reference is None or not interval or (step + 1) % interval:
            return {}
        return self._trainers("refresh_reference", "reference refresh", step, step, self.aux.reference.workers)[0]

    # ------------------------------------------------------------------ the critic
    def critic_update(self, step: int) -> dict[str, float]:
        critic = self.aux.critic
        if critic is None:
            return {}
        return self._group("critic", "critic update", step, lambda: critic.train(step))


def run_group(group: tuple[Stage, ...], step: int) -> dict[str, float]:
    """Run the stages of one group of `Stages.plan()` for step `step`, at the same time when there are several
    (each but the last in a thread of its own; the last on the caller's thread), each in its timeline span.
    Returns their metrics merged in the group's order. Every stage is waited for before an error is raised
    (the first in the group's order), so that no stage of a failed step is still writing when the loop stops;
    each stage's own calls are bounded by their deadlines."""

    def traced(stage: Stage) -> dict[str, float]:
        with timeline.span(stage.__name__, step=step, cat="train"):
            return stage(step)

    if len(group) == 1:
        return traced(group[0])
    started = [start_bounded(lambda stage=stage: traced(stage), Call("driver", stage.__name__, step=step),
                             deadline_s=None, flag="") for stage in group[:-1]]

    def outcome(run: Callable[[], dict[str, float]]) -> tuple[dict[str, float], BaseException | None]:
        try:
            return run(), None
        except Exception as exc:
            return {}, exc

    last = outcome(lambda: traced(group[-1]))  # the caller's stage, while the others run
    outcomes = [outcome(call.wait) for call in started] + [last]  # the group's order
    for _, error in outcomes:
        if error is not None:
            raise error
    merged: dict[str, float] = {}
    for metrics, _ in outcomes:
        merged.update(metrics)
    return merged
