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

import inspect
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence

# what a --slime-router-middleware-paths entry must name is checked before Ray, by the config layer
from relax.config.middleware_paths import (MIDDLEWARE_FLAG, MiddlewareError, load_middleware_factory,  # noqa: F401
                                           middleware_paths)


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
