"""An actor handle handed to another actor without its class: `DeferredHandle`.

Ray deserializes an actor handle by loading the actor's class in the receiving process. The rollout manager
receives trainer rank 0's handle as the weight source of engines that join later (`EnginePool.weight_source`),
and loading `TrainerWorker` there imports the trainer's module, Megatron-core with it, as the rollout manager
starts its router and engines: ~2-3 s of CPU on a path every run waits for, in a process that calls the handle
only when an engine is replaced or added. A `DeferredHandle` carries the handle as an object reference instead
(an object reference inside an argument is passed as it is, not resolved), and resolves it at its first use:
attribute access reads the handle's (`deferred.push_kept_weights.remote(...)`), so the receiver's code is the
same for a handle and a deferred one."""

from __future__ import annotations

from typing import Any


class DeferredHandle:
    def __init__(self, handle: Any = None, *, ref: Any = None):
        import ray

        self._ref = ref if ref is not None else ray.put(handle)
        self._handle: Any = None

    def resolve(self) -> Any:
        """The actor handle (its class is loaded in this process now, once)."""
        if self._handle is None:
            import ray

            self._handle = ray.get(self._ref)
        return self._handle

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # pickling and copy ask for dunders before __init__ has run
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    def __reduce__(self):  # the reference alone: never a resolved handle
        return (_rebuild, (self._ref,))


def _rebuild(ref: Any) -> DeferredHandle:
    return DeferredHandle(ref=ref)
