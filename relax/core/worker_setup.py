"""Ray's worker set-up hook for a run (runtime_env "worker_process_setup_hook", as `relax.core.ray_cluster`
passes it to ray.init): runs in every worker before its actor's module is imported."""

from __future__ import annotations

from relax.core.ray_serializers import defer_ray_serializers
from relax.data import tensordict_import
from relax.observability import console

WORKER_SETUP_HOOK = "relax.core.worker_setup.setup_worker"


def setup_worker() -> None:
    console.setup_worker()  # Relax's records in the driver's line shape
    tensordict_import.install()  # TransferQueue's own actors import tensordict without torch._dynamo
    defer_ray_serializers()  # before the worker's first task makes its serialization context
