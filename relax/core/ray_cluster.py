"""The run's Ray: the cluster RAY_ADDRESS names (`ray job submit`, a cluster started by hand), else a local one
started for the run."""

from __future__ import annotations

import os
from typing import Any

import ray

from relax.wire.auth import ENGINE_API_KEY_ENV, ensure_engine_api_key
from relax.config.env import worker_env
from relax.core.worker_setup import WORKER_SETUP_HOOK


def start_ray(config: Any) -> bool:
    """Connect to, or start, the run's Ray unless this process is connected already; True when this call did.
    Every role inherits the job's environment: the workers' settings and the run's engine key."""
    if ray.is_initialized():
        return False
    # One secret per run guards every engine's control endpoints; roles receive it in their environment.
    engine_key = {ENGINE_API_KEY_ENV: ensure_engine_api_key()}
    # the hook gives the roles' Relax records the driver's line shape, to keep them on the console
    job_env = {"env_vars": {**worker_env(), **engine_key}, "worker_process_setup_hook": WORKER_SETUP_HOOK}
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=job_env, log_to_driver=True)
    else:
        # No prestarted idle workers: Ray would start one per logical CPU (16+) for the first driver, each
        # importing Ray, while the roles start. Every role is an actor with a runtime env of its own, which a
        # plain prestarted worker cannot serve, so they only compete for the cores and for Ray's two
        # concurrent worker starts (measured: a 1-step embedded run 10-45% faster on 2 cores).
        ray.init(num_cpus=max(16, 4 * config.actor_world_size + 8), include_dashboard=False,
                 runtime_env=job_env, log_to_driver=True, _system_config={"prestart_worker_first_driver": False})
    return True
