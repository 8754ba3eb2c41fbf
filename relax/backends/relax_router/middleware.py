"""The router's middleware chain: what a middleware is, and how the chain is loaded and run.

A middleware is named by a dotted path (`--slime-router-middleware-paths a.b.C x.y.make`): the object
there (a class or a factory) is called with the router, `obj(router)`, when the router starts, and
must return an object with

    async def handle(self, request: ProxyRequest, call_next) -> ProxyResponse

`handle` sees every request the router forwards to an engine (`/generate` and the other engine
paths; not worker membership or health), may change it, answer it itself, or pass it on with
`await call_next(request)` and change the answer. Middlewares run in the order given; the last
`call_next` routes the request to an engine. A middleware may also serve endpoints of its own:
`routes()` returning `[(method, path, async handler(aiohttp.web.Request) -> aiohttp.web.Response)]`,
and release resources in an optional `async close()`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence

MIDDLEWARE_FLAG = "--slime-router-middleware-paths"


class MiddlewareError(ValueError):
    """A middleware path that cannot be loaded (config validation reports it as a ConfigError)."""


@dataclass
class ProxyRequest:
    method: str
    path: str  # e.g. "/generate"
    body: Any = None  # the decoded JSON body (None for a GET or an empty body)
    query: dict = field(default_factory=dict)
    # what requests with similar routing keys share (text prompts: the text), used by the routing policy
    route_key: Optional[str] = None


@dataclass
class ProxyResponse:
    status: int
    body: Any = None  # decoded JSON when the engine answered JSON, else bytes
    content_type: str = "application/json"
    worker: Optional[str] = None  # the engine that answered (None: answered by the router)


Handler = Callable[[ProxyRequest], Awaitable[ProxyResponse]]


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


def build_chain(paths: Sequence[str], router: Any) -> list[Any]:
    chain = []
    for path in paths:
        mw = load_middleware_factory(path)(router)
        if not inspect.iscoroutinefunction(getattr(mw, "handle", None)):
            raise MiddlewareError(f"{MIDDLEWARE_FLAG}: {path}(router) returned {type(mw).__name__}, which has no "
                              "`async def handle(request, call_next)`")
        chain.append(mw)
    return chain


def compose(chain: Sequence[Any], last: Handler) -> Handler:
    """One handler that runs `chain` in order, then `last`."""
    handler = last
    for mw in reversed(chain):
        def bind(mw=mw, nxt=handler) -> Handler:
            async def run(request: ProxyRequest) -> ProxyResponse:
                return await mw.handle(request, nxt)
            return run
        handler = bind()
    return handler
