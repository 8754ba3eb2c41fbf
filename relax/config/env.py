"""Environment variables for Ray workers: built-in defaults < configs/env.yaml < --train-env-vars."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Mapping

import yaml

# Set by the controller for --timeline-dump-dir (relax.observability.timeline): every role and the engine
# servers they start write their spans there.
TIMELINE_ENV = "RELAX_TIMELINE_DIR"
# Variables of the controller's own environment that every worker gets too.
# RELAX_SGLANG_PYTHON: the Python of a separate SGLang install (scripts/install_sglang_cpu.sh), which the engine
# actors launch SGLang's server with, also on a Ray cluster started outside Relax
PASSED_TO_WORKERS = (TIMELINE_ENV, "RELAX_SGLANG_PYTHON")

# Read by a library when it is imported, so needed in the driver's own environment too (relax-train sets them,
# unless set already, before it imports the controller): Ray pickles TransferQueue's storage-unit actor class from
# the driver, with the constants of the driver's module, so its TQ_NUM_THREADS is the driver's (8 when unset,
# which makes every storage call warn that 8 exceeds the cores), whatever the storage unit's environment says.
DRIVER_ENV = {"TQ_NUM_THREADS": "1"}

BUILTIN_ENV = {
    "TQ_NUM_THREADS": "1",  # TransferQueue warns on every call without it
    "RAY_DEDUP_LOGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


# The variables that every worker of a local Ray head started by Relax inherits from the head's environment
# (relax.core.ray_cluster.start_local_head), as JSON in the head's environment, which its workers inherit too.
HEAD_ENV_VAR = "RELAX_RAY_HEAD_ENV"
# The same, in the process that started the head (its own environment stays as it was, so that a process it
# starts later, e.g. another cluster's `ray start`, does not carry it); None once it connected elsewhere.
_started_head_env: dict[str, str] | None = None


def note_local_head(env: Mapping[str, str] | None) -> None:
    """Record what the workers of the Ray this process just started inherit (None: a cluster started elsewhere)."""
    global _started_head_env
    _started_head_env = None if env is None else {str(k): str(v) for k, v in env.items()}


def inherited_by_workers() -> dict[str, str]:
    """The variables a worker started now by this process's Ray gets without a runtime env: the local head's, in
    the process that started it; in a worker, the head's variables that this worker has with the same values
    (Ray gives an actor created without a runtime env its parent's, and a worker whose own runtime env changed
    one of them does not count on any). Empty where unknown (a cluster started elsewhere)."""
    if _started_head_env is not None:
        return _started_head_env
    given = json.loads(os.environ.get(HEAD_ENV_VAR) or "{}")
    return given if all(os.environ.get(k) == v for k, v in given.items()) else {}


def role_runtime_env(env: Mapping[str, str]) -> dict[str, dict[str, str]] | None:
    """The runtime env to create a role's actor with, for workers that need `env`: the variables its worker would
    not inherit already, or None when it inherits them all. Each worker with a runtime env is started through
    Ray's set-up process, a Python that imports Ray (~0.9 CPU s) before it execs the worker (docs/benchmarks.md,
    Start-up). On a cluster started elsewhere (RAY_ADDRESS) a role gets all of `env`, as before."""
    inherited = inherited_by_workers()
    missing = {str(k): str(v) for k, v in env.items() if inherited.get(str(k)) != str(v)}
    return {"env_vars": missing} if missing else None


def apply_driver_env() -> None:
    """DRIVER_ENV in this process's environment, where not set already."""
    for name, value in DRIVER_ENV.items():
        os.environ.setdefault(name, value)


def default_env_yaml() -> Path | None:
    override = os.environ.get("RELAX_ENV_YAML")
    if override:
        return Path(override)
    for candidate in (Path.cwd() / "configs" / "env.yaml", Path(__file__).resolve().parents[2] / "configs" / "env.yaml"):
        if candidate.is_file():
            return candidate
    return None


def load_env_yaml(path: Path | None) -> dict[str, str]:
    if path is None or not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    env = data.get("env_vars", {}) or {}
    if not isinstance(env, dict):
        raise ValueError(f"{path}: env_vars must be a mapping")
    return {str(k): str(v) for k, v in env.items()}


def worker_env(train_env_vars: Mapping[str, object] | None = None, *, training_role: bool = False,
               env_yaml: Path | None = None) -> dict[str, str]:
    """The layered environment for one worker."""
    env = dict(BUILTIN_ENV)
    env.update({name: os.environ[name] for name in PASSED_TO_WORKERS if name in os.environ})
    env.update(load_env_yaml(env_yaml if env_yaml is not None else default_env_yaml()))
    if training_role and train_env_vars:
        env.update({str(k): str(v) for k, v in train_env_vars.items()})
    return env


def shm_dir() -> str:
    """Where node-local shared files go (weight segments, the idle-core board): /dev/shm when writable."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def threads_per_process(processes: int, cpus: int | None = None) -> int:
    """torch threads for each of `processes` compute processes of one role on this node (trainer ranks, or
    engines): the node's cores less one, shared out, and at least one.

    One core is left for what runs beside the computing role (the rollout manager's HTTP and reward work,
    the router, Ray, the data plane): with every core given to OpenMP threads, a busy neighbour makes them
    wait on each other. Measured on 2 cores with other work running (load 4-14): the embedded default's 512
    answers took 5-8 s with 2 engine threads and 1.0-1.5 s with 1; its training step (512 log-prob rows and
    4 updates of 128) 3-8 s with 2 trainer threads and 0.6-0.9 s with 1."""
    cpus = cpus if cpus is not None else (os.cpu_count() or 2)
    return max(1, (cpus - 1) // max(1, processes))
