"""Import tensordict (TransferQueue's container) without importing torch._dynamo.

At import, tensordict wraps two of its helpers with `torch.compiler.allow_in_graph` and
`torch.compiler.assume_constant_result`; each call imports torch._dynamo (and through it sympy and the
inductor config): 1-1.5 s of CPU in every process that imports TransferQueue (its controller and storage
units, the rollout manager), paid again at every run's start on 2 cores. Both wrappers only mark a function
for a `torch.compile` trace; eagerly the function runs as it is, and nothing in these processes compiles.
So while tensordict's package runs its imports they are the identity, and they are restored right after.
A process that has imported torch._dynamo already imports tensordict unchanged (a trainer rank imports it only
when it builds its optimizer, after its modules: relax.backends.megatron.lazy_jit).

`install()` arms this for the process's first import of tensordict, whoever makes it: Relax's data-plane
modules call it before importing tensordict or TransferQueue, and Ray's worker set-up hook
(relax.core.worker_setup) in every worker, for TransferQueue's own actors. It imports nothing itself, so a
worker that never imports tensordict (an engine actor) pays nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any


def install() -> None:
    if "tensordict" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None):
        if name != "tensordict":
            return None
        sys.meta_path.remove(self)  # once: its submodules are found the usual way
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        if "torch._dynamo" in sys.modules:
            self.inner.exec_module(module)
            return
        import torch.compiler as compiler

        kept = compiler.allow_in_graph, compiler.assume_constant_result
        compiler.allow_in_graph = compiler.assume_constant_result = _identity
        try:
            self.inner.exec_module(module)
        finally:
            compiler.allow_in_graph, compiler.assume_constant_result = kept


def _identity(fn):
    return fn
