"""Auxiliary roles around the actor: which ones a run needs, and their per-step hooks.

The controller calls, every step:
    extras = aux.pre_train(step)          # e.g. {"ref_logprobs": [...], "values": [...]} per sample index
    ... actor trainer group trains with `extras` ...
    aux.post_train(step, metrics)         # e.g. critic update; may add metrics
    aux.after_weight_update(step)         # e.g. refresh the reference every --ref-update-interval
A role is a group of Ray actors created in `build_aux_roles`; runs without such roles get `NoAuxRoles`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


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


class ReferenceGroup:
    """The reference role: one `ReferenceWorker` per actor rank, in its own placement group."""

    def __init__(self, config: Any, *, use_gpu: bool):
        import os

        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from relax.config.env import worker_env
        from relax.core.placement import create_placement_group
        from relax.roles.reference import ReferenceWorker

        world = config.resource["actor"][0] * config.resource["actor"][1]
        bundles = [{"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0} for _ in range(world)]
        self.placement_group = create_placement_group(bundles, "relax-reference")
        threads = max(1, (os.cpu_count() or 2) // max(1, world))
        env = {"env_vars": worker_env(config.train_env_vars, training_role=True)}
        self.workers = [
            ReferenceWorker.options(num_cpus=1, num_gpus=1 if use_gpu else 0, runtime_env=env,
                                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                                        placement_group=self.placement_group, placement_group_bundle_index=rank)
                                    ).remote(config, rank, world, threads)
            for rank in range(world)
        ]
        try:
            addr, port = ray.get(self.workers[0].master_address.remote())
            backend = config.distributed_backend if use_gpu else "gloo"
            infos = ray.get([w.setup.remote(addr, port, backend) for w in self.workers])
        except BaseException:
            self.shutdown()
            raise
        logger.info("reference: %d rank(s), weights from %s", world, infos[0]["source"])

    def logprobs(self, step: int) -> tuple[list[list[float]], list[int], float]:
        """(per-sample reference log-probs in sample order, the samples' indices, seconds)."""
        import ray

        parts = ray.get([w.compute.remote(step) for w in self.workers])
        rows: list[Any] = [None] * parts[0]["num_samples"]
        for part in parts:
            for pos, row in zip(part["positions"], part["logprobs"]):
                rows[pos] = row
        if any(r is None for r in rows):
            raise RuntimeError(f"step {step}: the reference group left samples without log-probs")
        return rows, parts[0]["index"], max(p["seconds"] for p in parts)

    def save(self, path: str) -> None:
        import ray

        ray.get([w.save.remote(path) for w in self.workers])

    def load(self, path: str) -> None:
        import ray

        ray.get([w.load.remote(path) for w in self.workers])

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            try:
                ray.get(w.shutdown.remote(), timeout=30)
            except Exception:
                pass
            try:
                ray.kill(w)
            except Exception:
                pass
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass


class TrainingAuxRoles(AuxRoles):
    """Reference log-probs before each actor update; reference refresh every --ref-update-interval steps
    (the actor ranks copy their weights to their reference peers right after that step's update)."""

    def __init__(self, config: Any, reference: ReferenceGroup | None):
        self.config = config
        self.reference = reference

    def pre_train(self, step: int) -> dict[str, Any]:
        extras: dict[str, Any] = {}
        if self.reference is not None:
            rows, index, seconds = self.reference.logprobs(step)
            extras["ref_logprobs"] = rows
            extras["ref_sample_index"] = index
            extras["ref_seconds"] = seconds
            interval = self.config.ref_update_interval
            if interval and (step + 1) % interval == 0:
                extras["ref_update_targets"] = self.reference.workers
        return extras

    def save(self, path: str) -> None:
        if self.reference is not None and self.config.ref_update_interval:
            self.reference.save(str(Path(path) / "reference"))

    def load(self, path: str) -> None:
        if self.reference is not None and (Path(path) / "reference" / "meta.json").is_file():
            self.reference.load(str(Path(path) / "reference"))

    def shutdown(self) -> None:
        if self.reference is not None:
            self.reference.shutdown()
            self.reference = None


def build_aux_roles(config: Any, *, use_gpu: bool, data_plane: Any) -> AuxRoles:
    """Create the auxiliary role groups this config needs: a reference for --use-kl-loss / --kl-coef."""
    from relax.training.step import needs_reference

    if needs_reference(config) and not config.debug_rollout_only:
        return TrainingAuxRoles(config, ReferenceGroup(config, use_gpu=use_gpu))
    return NoAuxRoles()
