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
"""

from __future__ import annotations

from typing import Any, Callable

from relax.core.roles import AuxRoles


class Stages:
    def __init__(self, config: Any, aux: AuxRoles, *, trainers: Callable[..., list[Any]],
                 trainer0: Callable[..., Any], bounded: Callable[..., Any]):
        self.config = config
        self.aux = aux
        self._trainers = trainers
        self._trainer0 = trainer0
        self._bounded = bounded

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
