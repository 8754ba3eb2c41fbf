"""A module's first import in this process run inside a context (`patch_import`): for the start-up patches that
keep third-party imports from pulling in torch._dynamo (relax.data.tensordict_import,
relax.lazy_jit). Standard library only, so that arming a patch imports nothing."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable, ContextManager


def patch_import(name: str, context: Callable[[], ContextManager[Any]]) -> None:
    """Arm a one-shot import finder: whoever first imports module `name` (a top-level package or a submodule of
    one already imported), its code runs inside `context()`. Nothing when `name` is imported or armed already."""
    if name in sys.modules or any(isinstance(f, _Finder) and f.name == name for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder(name, context))


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, context: Callable[[], ContextManager[Any]]):
        self.name, self.context = name, context

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # once: the module's own imports are found the usual way
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, self.context)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, context: Callable[[], ContextManager[Any]]):
        self.inner, self.context = inner, context

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        with self.context():
            self.inner.exec_module(module)
