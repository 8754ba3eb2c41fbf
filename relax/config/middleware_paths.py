"""What a --slime-router-middleware-paths entry must name, checked before Ray starts (validation) and again when
the router builds its chain (relax.backends.relax_router.middleware): a dotted path to a class or factory that,
called with the router, returns an object with `async handle(request, call_next)`."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

MIDDLEWARE_FLAG = "--slime-router-middleware-paths"


class MiddlewareError(ValueError):
    """A middleware path that cannot be loaded (config validation reports it as a ConfigError)."""


def middleware_paths(value: Any) -> list[str]:
    """The flag's value as a list (its reference default is the empty string)."""
    if not value:
        return []
    if isinstance(value, str):
        return [p for p in value.split() if p]
    return [str(p) for p in value if p]


def load_middleware_factory(path: str) -> Callable[[Any], Any]:
    """The class or factory `path` names, checked as far as possible without building it (config
    validation calls this before Ray starts; errors name the flag)."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise MiddlewareError(f"{MIDDLEWARE_FLAG}: {path!r} is not a dotted path like package.module.Middleware")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise MiddlewareError(f"{MIDDLEWARE_FLAG}: cannot import module {module_name!r} "
                              f"({type(exc).__name__}: {exc})") from None
    if not hasattr(module, attr):
        raise MiddlewareError(f"{MIDDLEWARE_FLAG}: module {module_name!r} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if not callable(obj):
        raise MiddlewareError(f"{MIDDLEWARE_FLAG}: {path} is a {type(obj).__name__}, not a middleware class or factory "
                          "(called with the router, it returns an object with `async handle(request, call_next)`)")
    if inspect.isclass(obj) and not inspect.iscoroutinefunction(getattr(obj, "handle", None)):
        raise MiddlewareError(f"{MIDDLEWARE_FLAG}: class {path} has no `async def handle(self, request, call_next)`")
    return obj
