"""Relax's own router (`--use-slime-router`): an aiohttp server in front of the rollout engines.

Run:  python -m relax.backends.relax_router.server --host H --port P --request-timeout S
          [--max-connections N] [--failure-threshold K] [--health-interval S]
          [--middleware a.b.C ...] [--tokenizer DIR] [--parent-pid PID]

It serves the part of sglang-router's HTTP API that Relax uses, so that the rollout code talks to
either router the same way:
- membership: `POST /workers {"url"}`, `GET /workers`, `DELETE /workers/{id}`, and the older
  `POST /add_worker?url=`, `POST /remove_worker?url=`, `GET /list_workers`;
- `GET /health` (the router is up), `GET /readiness` (200 once a healthy engine is in, else 503);
- `POST /generate` and any other engine path, through the middleware chain (`middleware.py`) and
  then to one engine; `/abort_request`, `/flush_cache`, `/pause_generation` and
  `/continue_generation` go to every engine (a request id lives on one engine the router does
  not track). No healthy engine: HTTP 503, which Relax's clients wait out.

Routing: requests that carry text go to the engine that served the longest earlier text sharing a
prefix with them (its prefix cache holds that prefix) unless that engine has `AFFINITY_SLACK` more
requests in flight than the least loaded one; everything else goes to the least loaded engine.

Failures: a worker whose health check (`GET /health` every `--health-interval` s) or request fails
(no connection, or no answer within the deadline) `--failure-threshold` times in a row is removed and
listed under `evicted` in `GET /workers`; one success resets its count. A request that could not
connect is tried on another engine. Every engine request has a deadline (`--request-timeout`).

Security: every endpoint but generation and read-only status needs the run's key (relax.wire.auth),
as sglang-router with `--api-key` does; the router presents the same key to the engines. The router
exits when its parent process dies (`--parent-pid`) and on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp
from aiohttp import web

from relax.wire.auth import OPEN_ENDPOINTS, auth_headers, authorized, engine_api_key
from relax.backends.relax_router.middleware import ProxyRequest, ProxyResponse, build_chain, compose
from relax.backends.relax_router.radix import RadixTree

logger = logging.getLogger("relax.router")

ROUTER_OPEN_ENDPOINTS = OPEN_ENDPOINTS | {"/readiness"}
BROADCAST_PATHS = frozenset({"/abort_request", "/flush_cache", "/pause_generation", "/continue_generation"})
AFFINITY_SLACK = 4  # in-flight requests an engine may have above the least loaded one and still get its prefixes
AFFINITY_MIN_CHARS = 16  # a shorter shared prefix is no reason to prefer an engine
ROUTE_KEY_CHARS = 4096  # the start of a request that routing remembers (bounds the affinity tree's memory)
HEALTH_TIMEOUT_S = 5.0


def worker_id(url: str) -> str:
    return hashlib.sha1(url.encode()).hexdigest()[:16]


@dataclass
class Worker:
    url: str
    healthy: bool = True
    inflight: int = 0
    failures: int = 0  # consecutive failed health checks or requests
    served: int = 0

    def describe(self) -> dict:
        return {"id": worker_id(self.url), "url": self.url, "is_healthy": self.healthy, "load": self.inflight,
                "consecutive_failures": self.failures, "served": self.served}


@dataclass
class RouterSettings:
    request_timeout_s: float = 600.0
    max_connections: int = 0  # 0: no limit
    failure_threshold: int = 3
    health_interval_s: float = 5.0
    middleware_paths: tuple[str, ...] = ()
    tokenizer: Optional[str] = None  # the model folder whose tokenizer text-handling middlewares use
    affinity_entries: int = 4096  # texts remembered for prefix affinity (least recently used dropped)


class NoWorker(Exception):
    pass


class RelaxRouter:
    def __init__(self, settings: RouterSettings):
        self.settings = settings
        self.workers: dict[str, Worker] = {}
        self.evicted: dict[str, str] = {}  # url -> why it was removed
        self.affinity: RadixTree[str] = RadixTree(settings.affinity_entries)
        self.key = engine_api_key()
        self.session: Optional[aiohttp.ClientSession] = None
        self.health_session: Optional[aiohttp.ClientSession] = None
        self._health_task: Optional[asyncio.Task] = None
        self.chain = build_chain(settings.middleware_paths, self)
        self.handle = compose(self.chain, self.route)

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.settings.max_connections))
        # Health checks have their own pool: a full generation pool must not make healthy engines look dead.
        self.health_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        for mw in self.chain:
            if hasattr(mw, "close"):
                await mw.close()
        for s in (self.session, self.health_session):
            if s is not None:
                await s.close()

    # ------------------------------------------------------------------ membership and health
    def add(self, url: str) -> Worker:
        url = url.rstrip("/")
        self.evicted.pop(url, None)
        return self.workers.setdefault(url, Worker(url))

    def remove(self, url: str) -> bool:
        return self.workers.pop(url.rstrip("/"), None) is not None

    def failed(self, worker: Worker, why: str) -> None:
        worker.failures += 1
        if worker.failures >= self.settings.failure_threshold and self.workers.get(worker.url) is worker:
            del self.workers[worker.url]
            self.evicted[worker.url] = f"{worker.failures} consecutive failures, the last: {why}"
            logger.warning("removed worker %s: %s", worker.url, self.evicted[worker.url])

    def succeeded(self, worker: Worker) -> None:
        worker.failures = 0
        worker.healthy = True

    async def check(self, worker: Worker) -> bool:
        timeout = min(HEALTH_TIMEOUT_S, self.settings.request_timeout_s)
        try:
            async with self.health_session.get(worker.url + "/health",
                                               timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                await resp.read()
                ok, why = resp.status == 200, f"health check HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            ok, why = False, f"health check {type(exc).__name__}: {exc}"
        if ok:
            self.succeeded(worker)
        else:
            worker.healthy = False
            self.failed(worker, why)
        return ok

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            workers = list(self.workers.values())
            if workers:
                await asyncio.gather(*(self.check(w) for w in workers), return_exceptions=True)

    # ------------------------------------------------------------------ routing
    def pick(self, route_key: Optional[str], exclude: set[str] = frozenset()) -> Worker:
        live = [w for w in self.workers.values() if w.healthy and w.url not in exclude]
        if not live:
            raise NoWorker("no healthy engine behind the router")
        least = min(live, key=lambda w: (w.inflight, w.served))
        if route_key:
            matched, url = self.affinity.longest_prefix(route_key)
            w = self.workers.get(url) if url else None
            if (w is not None and w in live and matched >= AFFINITY_MIN_CHARS
                    and w.inflight <= least.inflight + AFFINITY_SLACK):
                return w
        return least

    async def route(self, request: ProxyRequest) -> ProxyResponse:
        """The end of the chain: one engine answers (another is tried when one cannot be reached)."""
        tried: set[str] = set()
        last = ""
        while True:
            try:
                worker = self.pick(request.route_key, tried)
            except NoWorker as exc:
                msg = str(exc) if not tried else f"{exc} (tried {sorted(tried)}: {last})"
                return ProxyResponse(503, {"error": {"message": msg}})
            tried.add(worker.url)
            if request.route_key:
                self.affinity.insert(request.route_key, worker.url)
            try:
                return await self.forward(worker, request)
            except aiohttp.ClientConnectorError as exc:  # the request never reached the engine: safe to retry
                last = f"{type(exc).__name__}: {exc}"
                self.failed(worker, last)
            except asyncio.TimeoutError:
                why = f"no answer within {self.settings.request_timeout_s:g} s"
                self.failed(worker, why)
                return ProxyResponse(504, {"error": {"message": f"{worker.url}: {why} (--slime-router-timeout)"}})
            except aiohttp.ClientError as exc:
                self.failed(worker, f"{type(exc).__name__}: {exc}")
                return ProxyResponse(502, {"error": {"message": f"{worker.url}: {type(exc).__name__}: {exc}"}})

    async def forward(self, worker: Worker, request: ProxyRequest) -> ProxyResponse:
        worker.inflight += 1
        try:
            kw: dict[str, Any] = {"headers": auth_headers(self.key), "params": request.query or None,
                                  "timeout": aiohttp.ClientTimeout(total=self.settings.request_timeout_s)}
            if request.body is not None:
                kw["json"] = request.body
            async with self.session.request(request.method, worker.url + request.path, **kw) as resp:
                raw = await resp.read()
                status, ctype = resp.status, resp.content_type
        finally:
            worker.inflight -= 1
        worker.served += 1
        self.succeeded(worker)
        body: Any = raw
        if ctype == "application/json" or raw[:1] in (b"{", b"["):
            try:
                body = json.loads(raw)
                ctype = "application/json"
            except ValueError:
                pass
        return ProxyResponse(status, body, ctype or "application/octet-stream", worker.url)

    async def broadcast(self, request: ProxyRequest) -> ProxyResponse:
        workers = list(self.workers.values())
        if not workers:
            return ProxyResponse(503, {"error": {"message": "no engine behind the router"}})

        async def one(w: Worker):
            try:
                return await self.forward(w, request)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.failed(w, f"{type(exc).__name__}: {exc}")
                return ProxyResponse(502, {"error": {"message": f"{type(exc).__name__}: {exc}"}}, worker=w.url)

        answers = await asyncio.gather(*(one(w) for w in workers))
        bad = {a.worker: a.status for a in answers if a.status != 200}
        return ProxyResponse(502 if bad else 200, {"success": not bad, "failed": bad,
                                                   "workers": [a.worker for a in answers]})


# ---------------------------------------------------------------------- HTTP layer

def _reply(resp: ProxyResponse) -> web.Response:
    if resp.content_type == "application/json" and not isinstance(resp.body, (bytes, bytearray)):
        return web.json_response(resp.body, status=resp.status)
    body = resp.body if isinstance(resp.body, (bytes, bytearray)) else str(resp.body).encode()
    return web.Response(body=body, status=resp.status, content_type=resp.content_type)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def route_key_of(body: Any) -> Optional[str]:
    if isinstance(body, dict):
        if isinstance(body.get("text"), str):
            return body["text"][:ROUTE_KEY_CHARS]
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids[:ROUTE_KEY_CHARS]):
            # a token prefix is a text prefix of this spelling
            return (",".join(map(str, ids[:ROUTE_KEY_CHARS])) + ",")[:ROUTE_KEY_CHARS]
    return None


def build_app(router: RelaxRouter) -> web.Application:
    @web.middleware
    async def require_key(request: web.Request, handler):
        if router.key and request.path not in ROUTER_OPEN_ENDPOINTS \
                and not authorized(request.headers.get("Authorization"), router.key):
            return _error(401, "this endpoint needs the run's key (Authorization: Bearer ...)")
        return await handler(request)

    app = web.Application(middlewares=[require_key], client_max_size=1 << 30)

    async def health(_):
        return web.json_response({"status": "ok", "workers": len(router.workers)})

    async def readiness(_):
        ready = any(w.healthy for w in router.workers.values())
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def list_workers(_):
        return web.json_response({"workers": [w.describe() for w in router.workers.values()],
                                  "evicted": [{"url": u, "reason": r} for u, r in router.evicted.items()]})

    async def legacy_list(_):
        return web.json_response({"urls": list(router.workers)})

    async def _url_of(request: web.Request) -> Optional[str]:
        url = request.query.get("url") or request.query.get("worker_url")
        if not url and request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                body = None
            if isinstance(body, dict):
                url = body.get("url") or body.get("worker_url")
        return url.rstrip("/") if isinstance(url, str) and url.startswith("http") else None

    async def add_worker(request: web.Request):
        url = await _url_of(request)
        if url is None:
            return _error(400, "give the worker as JSON {\"url\": \"http://host:port\"} or ?url=")
        worker = router.add(url)
        await router.check(worker)  # healthy at once when it answers; else the health loop retries it
        return web.json_response({"status": "accepted", "worker": worker.describe()},
                                 status=202 if request.path == "/workers" else 200)

    async def delete_worker(request: web.Request):
        wid = request.match_info["wid"]
        for url in list(router.workers):
            if wid in (worker_id(url), url):
                router.remove(url)
                return web.json_response({"status": "removed", "url": url}, status=202)
        return _error(404, f"no worker {wid}")

    async def legacy_remove(request: web.Request):
        url = await _url_of(request)
        if url is None or not router.remove(url):
            return _error(404, f"no worker {url}")
        return web.json_response({"status": "removed", "url": url})

    async def proxy(request: web.Request):
        body = None
        if request.can_read_body:
            raw = await request.read()
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError:
                    return _error(400, "the router forwards JSON bodies only")
        preq = ProxyRequest(request.method, request.path, body, dict(request.query), route_key_of(body))
        if request.path in BROADCAST_PATHS:
            return _reply(await router.broadcast(preq))
        return _reply(await router.handle(preq))

    app.router.add_get("/health", health)
    app.router.add_get("/readiness", readiness)
    app.router.add_get("/workers", list_workers)
    app.router.add_post("/workers", add_worker)
    app.router.add_delete("/workers/{wid}", delete_worker)
    app.router.add_get("/list_workers", legacy_list)
    app.router.add_post("/add_worker", add_worker)
    app.router.add_post("/remove_worker", legacy_remove)
    for mw in router.chain:
        for method, path, handler in (mw.routes() if hasattr(mw, "routes") else ()):
            app.router.add_route(method, path, handler)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


# ---------------------------------------------------------------------- process

def _parent_alive(ppid: int) -> bool:
    if os.getppid() != ppid:
        return False
    try:
        os.kill(ppid, 0)
    except ProcessLookupError:
        return False
    return True


async def serve(host: str, port: int, settings: RouterSettings, parent_pid: Optional[int] = None) -> None:
    router = RelaxRouter(settings)
    await router.open()
    runner = web.AppRunner(build_app(router), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    logger.info("relax router on %s:%d (middlewares: %s)", host, port, list(settings.middleware_paths) or "none")
    try:
        while not stop.is_set():
            if parent_pid is not None and not _parent_alive(parent_pid):
                logger.warning("parent process %d is gone; exiting", parent_pid)
                break
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass
    finally:
        await runner.cleanup()
        await router.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Relax's router (--use-slime-router)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--request-timeout", type=float, required=True, help="deadline of one engine request (s)")
    p.add_argument("--max-connections", type=int, default=0, help="connections to the engines at once (0: no limit)")
    p.add_argument("--failure-threshold", type=int, default=3)
    p.add_argument("--health-interval", type=float, default=5.0)
    p.add_argument("--middleware", nargs="*", default=[])
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--parent-pid", type=int, default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = RouterSettings(request_timeout_s=args.request_timeout, max_connections=max(0, args.max_connections),
                              failure_threshold=max(1, args.failure_threshold),
                              health_interval_s=args.health_interval, middleware_paths=tuple(args.middleware),
                              tokenizer=args.tokenizer)
    started = time.monotonic()
    asyncio.run(serve(args.host, args.port, settings, args.parent_pid))
    logger.info("relax router stopped after %.0f s", time.monotonic() - started)
    sys.exit(0)


if __name__ == "__main__":
    main()
