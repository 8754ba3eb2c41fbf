"""The run's Ray: the cluster RAY_ADDRESS names (`ray job submit`, a cluster started by hand), else a local one
started for the run."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Mapping

import ray

from relax.wire.auth import ENGINE_API_KEY_ENV, ensure_engine_api_key
from relax.config.env import HEAD_ENV_VAR, note_local_head, worker_env
from relax.core.ray_serializers import defer_ray_serializers
from relax.core.worker_setup import WORKER_SETUP_HOOK


def start_ray(config: Any) -> bool:
    """Connect to, or start, the run's Ray unless this process is connected already; True when this call did.
    Every role inherits the job's environment: the workers' settings and the run's engine key."""
    if ray.is_initialized():
        return False
    job_vars = job_env_vars()
    address = os.environ.get("RAY_ADDRESS")
    if address:
        note_local_head(None)  # this cluster's environment is not ours to know
        defer_ray_serializers()  # the driver's serialization context is made by ray.init
        # the hook gives the roles' Relax records the driver's line shape, to keep them on the console
        ray.init(address=address, runtime_env={"env_vars": job_vars, "worker_process_setup_hook": WORKER_SETUP_HOOK},
                 log_to_driver=True)
    else:
        # No prestarted idle workers: Ray would start one per logical CPU (16+) for the first driver, each
        # importing Ray while the roles start, many more than a run's few roles use; they compete for the
        # cores and for Ray's two concurrent worker starts (measured: a 1-step embedded run 10-45% faster on
        # 2 cores).
        with lean_head():
            start_local_head(job_vars, num_cpus=max(16, 4 * config.actor_world_size + 8), include_dashboard=False,
                             log_to_driver=True, _system_config={"prestart_worker_first_driver": False})
    return True


def job_env_vars() -> dict[str, str]:
    """The variables every role of the run gets: the workers' settings and the run's engine key (one secret per
    run guards every engine's control endpoints)."""
    return {**worker_env(), ENGINE_API_KEY_ENV: ensure_engine_api_key()}


def start_local_head(env: Mapping[str, str], **init_kwargs: Any) -> None:
    """ray.init of a local head whose workers all get `env` and run Relax's worker set-up hook, without a runtime
    env: both go into the head's own environment, which its raylet hands to every worker it starts. A runtime
    env (the job's or a role's) would start each worker through Ray's set-up process, which imports Ray before it
    execs the worker: ~0.9 CPU s and ~0.4 s more per worker (4 bare actors: 4.4-5.3 CPU s without, 7.8-8.7 with
    one; docs/benchmarks.md, Start-up), paid by each of a run's 5-8 roles' processes on 2 cores. Ray hands a
    runtime env's hook to its worker the same way, in the variable WORKER_PROCESS_SETUP_HOOK_ENV_VAR names, which
    every worker reads at its start. This process's environment is restored afterwards; the roles it launches
    read what the workers inherit from relax.config.env.inherited_by_workers."""
    from ray._private import ray_constants

    defer_ray_serializers()  # the driver's serialization context is made by ray.init
    hook_var = getattr(ray_constants, "WORKER_PROCESS_SETUP_HOOK_ENV_VAR", None)
    if hook_var is None:  # a Ray that reads the hook from elsewhere: the job's runtime env, as before
        note_local_head(None)
        ray.init(runtime_env={"env_vars": dict(env), "worker_process_setup_hook": WORKER_SETUP_HOOK}, **init_kwargs)
        return
    given = {**env, hook_var: WORKER_SETUP_HOOK, HEAD_ENV_VAR: json.dumps(dict(env), sort_keys=True)}
    saved = {name: os.environ.get(name) for name in given}
    os.environ.update(given)
    try:
        ray.init(**init_kwargs)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    note_local_head(env)


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
