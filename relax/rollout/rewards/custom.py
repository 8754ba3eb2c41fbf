"""User reward functions loaded by dotted path: ``fn(args, sample)`` or ``async fn(args, sample)``.

In group mode (``--group-rm``) the same function is called once per group as
``fn(args, samples)`` and must return one reward per sample.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
from concurrent.futures import Executor
from typing import Any, Callable, Optional

__all__ = ["CustomReward", "load_custom_reward", "import_by_path"]


def import_by_path(path: str) -> Any:
    """Import ``"pkg.module.attr"`` (or ``"pkg.module:attr"``) and return the attribute."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"custom reward path must be 'pkg.module.func', got {path!r}")
    path = path.strip()
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"custom reward path must be 'pkg.module.func', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"custom reward {path!r}: cannot import module {module_name!r}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"custom reward {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


class CustomReward:
    """Adapter that calls a sync or async user function the same way.

    ``await adapter.acall(args, sample, executor=...)`` awaits an async function and
    runs a sync one in ``executor`` (default: the loop's); a sync function that
    returns an awaitable is awaited too. ``adapter(args, sample)`` is the blocking
    form (it runs an async function with ``asyncio.run``, so it cannot be used from
    inside a running event loop).
    """

    def __init__(self, fn: Callable[..., Any], path: Optional[str] = None) -> None:
        if not callable(fn):
            raise TypeError(f"custom reward {path or fn!r} is not callable")
        self.fn = fn
        self.path = path or getattr(fn, "__qualname__", repr(fn))

    @property
    def is_async(self) -> bool:
        fn = self.fn
        return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))

    async def acall(self, *args: Any, executor: Optional[Executor] = None) -> Any:
        if self.is_async:
            return await self.fn(*args)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(executor, functools.partial(self.fn, *args))
        if inspect.isawaitable(result):
            result = await result
        return result

    def __call__(self, *args: Any) -> Any:
        result = self.fn(*args)
        if inspect.isawaitable(result):
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return asyncio.run(_await(result))
            if inspect.iscoroutine(result):
                result.close()
            raise RuntimeError(f"custom reward {self.path} is async; inside an event loop use 'await .acall(...)'")
        return result

    def __repr__(self) -> str:
        return f"CustomReward({self.path}, async={self.is_async})"


async def _await(aw: Any) -> Any:
    return await aw


def load_custom_reward(path: str) -> CustomReward:
    """Load ``"pkg.module.func"`` as a ``CustomReward`` (errors name the path)."""
    fn = import_by_path(path)
    if not callable(fn):
        raise TypeError(f"custom reward {path!r} is not callable (got {type(fn).__name__})")
    return CustomReward(fn, path)
