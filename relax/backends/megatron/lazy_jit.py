"""Import Megatron-core without importing torch._dynamo and the inductor: its jit fuser compiles on first call.

`megatron.core.jit` sets `jit_fuser = torch.compile` when it is imported, and Megatron's fusion modules decorate
their functions with it at import (`@jit_fuser def swiglu...`). Each `torch.compile(fn)` imports torch._dynamo
and the inductor's compile_fx: 1-2 s of CPU in every process that imports the trainer's modules (the driver,
which only builds the controller, and every Megatron rank), paid again at every run's start on 2 cores.
`torch.compile(fn)` compiles nothing until `fn` is first called; so while `megatron.core.jit` runs its import,
`torch.compile` is a version that defers the call to torch.compile itself to `fn`'s first call (same function,
same options; then the compiled function is used from there on). Megatron's jit fuser therefore means what it
means upstream; only the import is deferred. Relax turns Megatron's fusions off in its model config
(relax.backends.megatron.arch), so the fused functions are not called at all there. (A trainer rank still imports
torch._dynamo when it builds its optimizer: torch.optim's `add_param_group` is wrapped by `torch._disable_dynamo`.)

`install()` arms this for the process's first import of `megatron.core.jit`; `relax/__init__.py` calls it, so
every process that imports Relax has it before Megatron. It imports nothing itself. `--disable-jit-fuser`
(relax.backends.megatron.megatron_options) replaces the fuser afterwards as before.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

TARGET = "megatron.core.jit"


def install() -> None:
    if TARGET in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


def deferred_compile(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A `torch.compile` that calls `compile_fn(fn, **options)` at `fn`'s first call instead of at decoration."""

    def compile_later(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        if fn is None:  # used as @torch.compile(**options)
            return lambda f: compile_later(f, **options)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(compile_fn(fn, **options))
            return compiled[0](*args, **kwargs)

        return call

    return compile_later


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once
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
        import torch

        kept = torch.compile
        torch.compile = deferred_compile(kept)
        try:
            self.inner.exec_module(module)
        finally:
            torch.compile = kept
