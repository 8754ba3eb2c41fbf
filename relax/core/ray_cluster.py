"""The run's Ray: the cluster RAY_ADDRESS names (`ray job submit`, a cluster started by hand), else a local one
started for the run."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

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
        with lean_head():
            ray.init(num_cpus=max(16, 4 * config.actor_world_size + 8), include_dashboard=False,
                     runtime_env=job_env, log_to_driver=True,
                     _system_config={"prestart_worker_first_driver": False})
    return True


@contextlib.contextmanager
def lean_head() -> Iterator[None]:
    """A local head node without the two Python processes a run never uses: the dashboard's API server (with
    include_dashboard=False Ray still starts it for its usage-stats module, and ray.init waits for it to come up
    before it starts the raylet) and the autoscaler's monitor (a fixed one-node cluster; Relax's own engine
    autoscaler is relax.rollout.autoscaler). Both would import Ray for ~1-2 s of CPU each while the roles start;
    measured: ~2 s less CPU in Ray's own processes, and ray.init shorter by their serial wait. Each is
    skipped only where this Ray has the method (the head then runs as when the dashboard failed to start: no
    web UI address); RELAX_RAY_FULL_HEAD=1 keeps them."""
    from ray._private import node

    names = [n for n in ("start_api_server", "start_monitor") if callable(vars(node.Node).get(n))]
    if os.environ.get("RELAX_RAY_FULL_HEAD") == "1" or not names:
        yield
        return
    saved = {n: node.Node.__dict__[n] for n in names}
    for n in names:
        setattr(node.Node, n, lambda self, *args, **kwargs: None)
    try:
        yield
    finally:
        for n, method in saved.items():
            setattr(node.Node, n, method)
