"""Auxiliary roles around the actor: which ones a run needs, and their per-step hooks.

The controller calls, every step:
    extras = aux.pre_train(step)          # e.g. {"ref_logprobs": [...], "values": [...]} per sample index
    ... actor trainer group trains with `extras` ...
    aux.post_train(step, metrics)         # e.g. critic update; may add metrics
    aux.after_weight_update(step)         # e.g. refresh the reference every --ref-update-interval
A role is a group of Ray actors created in `build_aux_roles`; runs without such roles get `NoAuxRoles`.
"""

from __future__ import annotations

from typing import Any


class AuxRoles:
    """The roles besides actor and rollout (reference, critic, ...)."""

    def pre_train(self, step: int) -> dict[str, Any]:
        return {}

    def post_train(self, step: int, metrics: dict[str, float]) -> None:
        return None

    def after_weight_update(self, step: int) -> None:
        return None

    def save(self, path: str) -> None:
        return None

    def load(self, path: str) -> None:
        return None

    def shutdown(self) -> None:
        return None


class NoAuxRoles(AuxRoles):
    pass


def build_aux_roles(config: Any, *, use_gpu: bool, data_plane: Any) -> AuxRoles:
    """Create the auxiliary role groups this config needs (none yet in the synchronous GRPO loop)."""
    return NoAuxRoles()
