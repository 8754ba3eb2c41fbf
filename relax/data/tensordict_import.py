"""Import tensordict (TransferQueue's container) without importing torch._dynamo.

At import, tensordict wraps two of its helpers with `torch.compiler.allow_in_graph` and
`torch.compiler.assume_constant_result`; each call imports torch._dynamo (and through it sympy and the
inductor config): 1-1.5 s of CPU in every process that imports TransferQueue (its controller and storage
units, the rollout manager), paid again at every run's start on 2 cores. Both wrappers only mark a function
for a `torch.compile` trace; eagerly the function runs as it is, and nothing in these processes compiles.
So while tensordict's package runs its imports they are the identity, and they are restored right after.
A process that has imported torch._dynamo already imports tensordict unchanged (a trainer rank imports it only
when it builds its optimizer, after its modules: relax.lazy_jit).

`install()` arms this for the process's first import of tensordict, whoever makes it (relax.importing): Relax's data-plane
modules call it before importing tensordict or TransferQueue, and Ray's worker set-up hook
(relax.core.worker_setup) in every worker, for TransferQueue's own actors. It imports nothing itself, so a
worker that never imports tensordict (an engine actor) pays nothing.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from relax.importing import patch_import


def install() -> None:
    patch_import("tensordict", _without_dynamo_wrappers)


@contextlib.contextmanager
def _without_dynamo_wrappers() -> Iterator[None]:
    if "torch._dynamo" in sys.modules:  # nothing to save
        yield
        return
    import torch.compiler as compiler  # torch itself is imported by tensordict's first line anyway

    kept = compiler.allow_in_graph, compiler.assume_constant_result
    compiler.allow_in_graph = compiler.assume_constant_result = _identity
    try:
        yield
    finally:
        compiler.allow_in_graph, compiler.assume_constant_result = kept


def _identity(fn):
    return fn
