"""Import Megatron-core without importing torch._dynamo and the inductor: its jit fuser compiles on first call.

`megatron.core.jit` sets `jit_fuser = torch.compile` when it is imported, and Megatron's fusion modules decorate
their functions with it at import (`@jit_fuser def swiglu...`). Each `torch.compile(fn)` imports torch._dynamo
and the inductor's compile_fx: 1-2 s of CPU in every process that imports the trainer's modules (the driver,
which only builds the controller, and every Megatron rank), paid again at every run's start on 2 cores.
`torch.compile(fn)` compiles nothing until `fn` is first called; so while `megatron.core.jit` runs its import,
`torch.compile` is a version that defers the call to torch.compile itself to `fn`'s first call (same function,
same options; then the compiled function is used from there on). Megatron's jit fuser therefore means what it
means upstream; only the import is deferred. Relax turns Megatron's fusions off in its model config
(relax.formats.model_arch), so the fused functions are not called at all there. (A trainer rank still imports
torch._dynamo when it builds its optimizer: torch.optim's `add_param_group` is wrapped by `torch._disable_dynamo`.)

`install()` arms this for the process's first import of `megatron.core.jit` (relax.importing.patch_import);
`relax/__init__.py` calls it, so every process that imports Relax has it before Megatron. It imports nothing
itself. `--disable-jit-fuser` (relax.backends.megatron.megatron_options) replaces the fuser afterwards as before.
It lives at the package root, beside relax.heap, because the package root may import nothing heavier.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

from relax.importing import patch_import

TARGET = "megatron.core.jit"


def install() -> None:
    patch_import(TARGET, _compile_deferred)


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


@contextlib.contextmanager
def _compile_deferred() -> Iterator[None]:
    import torch  # only when Megatron is imported: `import relax` itself stays light

    kept = torch.compile
    torch.compile = deferred_compile(kept)
    try:
        yield
    finally:
        torch.compile = kept
