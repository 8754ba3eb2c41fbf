"""Megatron's RNG tracker forks turned off on one thread, for a forward-only pass run beside another pass.

Megatron's model forks its RNG tracker around every dropout (`get_cuda_rng_tracker().fork()`, also in eval mode,
where dropout is the identity): the fork swaps the process's generator state (on CPU, torch's global generator,
relax.backends.megatron.cpu_compat) and records the tracker's current state name, and checks both when it
leaves. Both are process-wide, so two threads forking at once swap each other's states ("current state name
default-rng is not the same as the desired state name model-parallel-rng", or, worse, a generator left in
another thread's state). A forward-only pass in eval mode draws no random numbers, so its forks do nothing
useful: `forks_off()` makes them no-ops on the calling thread only (as Megatron's own inference tracker does for
every thread), and the thread beside it forks as before.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_state = threading.local()
_patch_lock = threading.Lock()
_patched = False


def _patch() -> None:
    global _patched
    with _patch_lock:
        if _patched:
            return
        from megatron.core.tensor_parallel import random as mcore_random

        fork = mcore_random.CudaRNGStatesTracker.fork

        def fork_unless_off(self, *args, **kwargs):
            if getattr(_state, "off", False):
                return contextlib.nullcontext()
            return fork(self, *args, **kwargs)

        mcore_random.CudaRNGStatesTracker.fork = fork_unless_off
        _patched = True


@contextlib.contextmanager
def forks_off() -> Iterator[None]:
    """Within the block, Megatron's RNG tracker forks on this thread are no-ops (for forward-only passes in eval
    mode, which draw no random numbers)."""
    _patch()
    _state.off = True
    try:
        yield
    finally:
        _state.off = False
