"""Placement groups from the worker counts config validation derived from `--resource`
(`actor_world_size`, `num_engines`): GPU bundles on GPU clusters, CPU bundles otherwise. Each trainer rank
and each engine Relax starts gets one bundle; an engine added beyond those gets a group of its own
(`engine_bundle`)."""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def engine_bundle(config: Any, use_gpu: bool) -> dict[str, float]:
    """What one engine Relax starts takes: its --rollout-num-gpus-per-engine devices and a CPU. An engine added
    at run time (relax.rollout.engine_pool) gets a placement group of one such bundle."""
    return {"GPU": float(config.rollout_num_gpus_per_engine), "CPU": 1.0} if use_gpu else {"CPU": 1.0}


def role_bundles(config: Any, role: str, use_gpu: bool) -> list[dict[str, float]]:
    """One bundle per trainer rank (role "actor") or per engine Relax starts (role "rollout")."""
    if role == "rollout":
        engines = 0 if config.rollout_external else config.num_engines
        return [engine_bundle(config, use_gpu) for _ in range(engines)]
    if role == "actor":
        return [{"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0} for _ in range(config.actor_world_size)]
    raise ValueError(f"no bundles are reserved for role {role!r} here (auxiliary roles use the actor's layout)")


def create_placement_group(bundles: list[dict[str, float]], name: str, timeout_s: float = 120.0):
    if not bundles:
        return None
    pg = placement_group(bundles, strategy="PACK", name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except Exception:
        raise RuntimeError(f"placement group {name!r} ({len(bundles)} bundles of {bundles[0]}) could not be "
                           f"reserved within {timeout_s:.0f}s; cluster has {ray.cluster_resources()}") from None
    return pg


# --colocate: a trainer rank and an engine share one bundle (one GPU). The trainer takes a fraction of the
# GPU so that Ray lets the engine actor onto the same bundle (slime does the same); the two take turns through
# offloading (relax.core.colocate), not through Ray's accounting.
COLOCATED_TRAINER_GPU_FRACTION = 0.4


def colocated_bundles(config: Any, use_gpu: bool) -> list[dict[str, float]]:
    """One bundle per trainer rank (and at least one per engine), each with room for a trainer and an engine."""
    count = max(len(role_bundles(config, "actor", use_gpu)), len(role_bundles(config, "rollout", use_gpu)))
    return [{"GPU": 1.0, "CPU": 2.0} if use_gpu else {"CPU": 2.0} for _ in range(count)]


def trainer_gpus(config: Any, use_gpu: bool) -> float:
    if not use_gpu:
        return 0
    return COLOCATED_TRAINER_GPU_FRACTION if config.colocate else 1
