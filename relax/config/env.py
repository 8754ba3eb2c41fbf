"""Environment variables for Ray workers: built-in defaults < configs/env.yaml < --train-env-vars."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import yaml

BUILTIN_ENV = {
    "TQ_NUM_THREADS": "1",  # TransferQueue warns on every call without it
    "RAY_DEDUP_LOGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


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
    env.update(load_env_yaml(env_yaml if env_yaml is not None else default_env_yaml()))
    if training_role and train_env_vars:
        env.update({str(k): str(v) for k, v in train_env_vars.items()})
    return env
