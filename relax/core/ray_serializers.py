"""Ray's serializers for pydantic, starlette and pyarrow objects, registered when each package is imported in
this process rather than imported for them.

When a process makes its first Ray serialization context (a worker at its first task, the driver at ray.init),
Ray's `ray.util.serialization_addons.apply` imports pydantic, starlette and pyarrow to register custom
serializers for their types: ~0.4-0.5 CPU s in every worker of a run, most of which (the TransferQueue
controller and storage units, the engine actors, the trainer ranks) never use any of the three. Measured: 4 bare
actors came up with 3.7-3.9 CPU s instead of 4.6-5.7 (docs/benchmarks.md, Start-up). The registrations only
add entries to cloudpickle's process-wide dispatch table, which objects of a type can only meet once its
package is imported; so each is made where its package is imported already, or right after its first import
(relax.importing.patch_import), with Ray's own registration functions. Ray's `apply` is replaced only where it
names exactly the functions below (a Ray whose `apply` registers anything else keeps its own).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

from relax.importing import patch_import


# every global name Ray's `serialization_addons.apply` refers to (Ray 2.60): what `_registrations` stands in for
KNOWN_APPLY_NAMES = {"ray._common.pydantic_compat", "register_pydantic_serializers", "register_starlette_serializer",
                     "sys", "platform", "ray._private.arrow_serialization", "_register_custom_datasets_serializers"}


def defer_ray_serializers() -> None:
    """Replace Ray's `serialization_addons.apply` (once per process) by one that registers each package's
    serializers when that package is imported."""
    from ray.util import serialization_addons

    if getattr(serialization_addons.apply, "_relax_deferred", False):
        return
    registrations = _registrations(serialization_addons)
    if registrations is None:
        return

    def apply(context: Any) -> None:
        for package, register in registrations.items():
            if package in sys.modules:
                register(context)
            else:
                patch_import(package, lambda register=register: _then(register, context))

    apply._relax_deferred = True  # type: ignore[attr-defined]
    serialization_addons.apply = apply


def _registrations(serialization_addons: Any) -> dict[str, Callable[[Any], None]] | None:
    """Ray's registration function of each package, or None where Ray's `apply` is not the one they stand in for
    (looked up without importing them: importing Ray's pydantic module imports pydantic)."""
    if set(serialization_addons.apply.__code__.co_names) != KNOWN_APPLY_NAMES:
        return None
    starlette = serialization_addons.register_starlette_serializer

    def pydantic(context: Any) -> None:
        from ray._common.pydantic_compat import register_pydantic_serializers

        register_pydantic_serializers(context)

    def pyarrow(context: Any) -> None:
        if sys.platform == "win32":  # as Ray's own apply
            return
        from ray._private.arrow_serialization import _register_custom_datasets_serializers

        _register_custom_datasets_serializers(context)

    return {"pydantic": pydantic, "starlette": starlette, "pyarrow": pyarrow}


@contextlib.contextmanager
def _then(register: Callable[[Any], None], context: Any) -> Iterator[None]:
    yield  # the package's own import
    register(context)
