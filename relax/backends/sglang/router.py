"""Run the real sglang-router (`python -m sglang_router.launch_router`) and manage its workers.

Measured against sglang-router 0.3.2: the router starts with no workers (`/health` answers 200,
`/readiness` 503 until a worker is healthy); membership changes at run time through
`POST /workers {"url"}` (202, queued; the worker shows in `GET /workers` once its `/health`
answered) and `DELETE /workers/{id}` (202). `add_worker` / `remove_worker` wait until the change
is visible in `GET /workers`. Routers older than 0.2 (`/add_worker?url=`, `/remove_worker?url=`,
`/list_workers`) are used as a fallback when `/workers` answers 404.

Each router gets its own Prometheus port (a free one, unless `--prometheus-port` is in
`extra_args`): the default 29000 would make a second router on the host fail to start.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Mapping, Sequence

import requests

from relax.wire.auth import auth_headers, ensure_engine_api_key
from relax.wire.net import ManagedProcess, find_free_port, url_host, wait_http_ok, with_parent_watchdog


class RouterError(RuntimeError):
    pass


def _extra_args_to_cli(extra_args: Sequence[str] | Mapping[str, Any] | None) -> list[str]:
    if not extra_args:
        return []
    if isinstance(extra_args, Mapping):
        out: list[str] = []
        for key, val in extra_args.items():
            flag = "--" + str(key).replace("_", "-")
            if val is None or val is False:
                continue
            if val is True:
                out.append(flag)
            elif isinstance(val, (list, tuple)):
                out.append(flag)
                out.extend(str(v) for v in val)
            else:
                out += [flag, str(val)]
        return out
    return [str(a) for a in extra_args]


def build_router_command(
    host: str,
    port: int,
    policy: str = "round_robin",
    extra_args: Sequence[str] | Mapping[str, Any] | None = None,
    worker_urls: Sequence[str] = (),
) -> list[str]:
    extra = _extra_args_to_cli(extra_args)
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(int(port)),
           "--policy", policy]
    if "--api-key" not in extra:
        # With a key the router requires it from its clients (generation and worker membership alike) and
        # presents it to the workers, whose control endpoints need it (relax.wire.auth).
        cmd += [f"--api-key={ensure_engine_api_key()}"]  # one token: safe whatever the key's first character
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    if "--log-level" not in extra:
        cmd += ["--log-level", "warn"]
    if "--prometheus-port" not in extra:
        # The default (29000) is shared by every router on the host: two routers would collide.
        cmd += ["--prometheus-host", host, "--prometheus-port", str(find_free_port(host))]
    return cmd + extra


class RouterProcess(ManagedProcess):
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        policy: str = "round_robin",
        extra_args: Sequence[str] | Mapping[str, Any] | None = None,
        *,
        worker_urls: Sequence[str] = (),
        log_path: str | None = None,
        request_timeout_s: float = 30.0,
        exit_with_parent: bool = True,
    ):
        self.host = host
        self.port = int(port) if port else find_free_port(host)
        self.policy = policy
        self.request_timeout_s = request_timeout_s
        self._legacy_api: bool | None = None
        # Ports Relax picked itself (a free port is only free until someone else binds it: on a busy host
        # another process can take it between the probe and the router's bind) are picked again on a clash.
        self._ports_chosen = not port and "--prometheus-port" not in _extra_args_to_cli(extra_args)
        self._command = lambda: build_router_command(host, self.port, policy, extra_args, worker_urls)
        self._exit_with_parent = exit_with_parent
        super().__init__(self._wrapped(self._command()), log_path=log_path, name=f"router-{self.port}")

    def _wrapped(self, cmd: list[str]) -> list[str]:
        return with_parent_watchdog(cmd) if self._exit_with_parent else cmd

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    def start(self, timeout_s: float = 30.0, port_attempts: int = 3) -> "RouterProcess":  # type: ignore[override]
        for attempt in range(port_attempts):
            super().start()
            try:
                wait_http_ok(self.url + "/health", timeout_s, alive=self.is_alive)
                return self
            except (TimeoutError, RuntimeError) as exc:
                tail = self.log_tail()
                self.stop()
                if self._ports_chosen and "Address already in use" in tail and attempt + 1 < port_attempts:
                    self.port = find_free_port(self.host)  # the prometheus port is picked anew by the command
                    self.cmd = [str(c) for c in self._wrapped(self._command())]
                    self.name = f"router-{self.port}"
                    continue
                raise RouterError(f"sglang-router did not start: {exc}\n--- log tail ---\n{tail}") from None
        raise AssertionError("unreachable")

    # ----------------------------------------------------------------------------- HTTP helpers
    def _call(self, method: str, endpoint: str, **kw) -> requests.Response:
        try:
            return requests.request(method, self.url + endpoint, timeout=self.request_timeout_s,
                                    headers=auth_headers(), **kw)
        except requests.RequestException as exc:
            raise RouterError(f"router request {self.url}{endpoint} failed: {exc}") from None

    @staticmethod
    def _norm(url: str) -> str:
        return url.rstrip("/")

    # ----------------------------------------------------------------------------- membership
    def list_workers(self) -> list[dict]:
        """Workers as the router reports them: dicts with at least `url` (and `id`, `is_healthy`)."""
        if self._legacy_api is not True:
            resp = self._call("GET", "/workers")
            if resp.status_code == 200:
                self._legacy_api = False
                return list(self._json(resp, "/workers").get("workers", []))
            if resp.status_code != 404:
                raise RouterError(f"GET {self.url}/workers: HTTP {resp.status_code}: {resp.text[:300]}")
        resp = self._call("GET", "/list_workers")
        if resp.status_code != 200:
            raise RouterError(f"GET {self.url}/list_workers: HTTP {resp.status_code}: {resp.text[:300]}")
        self._legacy_api = True
        return [{"url": u} for u in self._json(resp, "/list_workers").get("urls", [])]

    def _json(self, resp, endpoint: str) -> dict:
        try:
            return resp.json()
        except ValueError:  # seen once on a loaded 2-core machine: 200 with a body that was not JSON
            raise RouterError(f"GET {self.url}{endpoint}: HTTP 200 with a body that is not JSON: "
                              f"{resp.text[:200]!r}") from None

    def worker_urls(self) -> list[str]:
        return [self._norm(w["url"]) for w in self.list_workers()]

    def add_worker(self, url: str, *, wait: bool = True, timeout_s: float = 120.0) -> None:
        url = self._norm(url)
        if self._legacy_api is not True:
            resp = self._call("POST", "/workers", json={"url": url})
            if resp.status_code in (200, 201, 202):
                self._legacy_api = False
            elif resp.status_code == 404:
                self._legacy_api = True
            else:
                raise RouterError(f"POST {self.url}/workers {url}: HTTP {resp.status_code}: {resp.text[:300]}")
        if self._legacy_api:
            resp = self._call("POST", "/add_worker", params={"url": url})
            if resp.status_code != 200:
                raise RouterError(f"POST {self.url}/add_worker {url}: HTTP {resp.status_code}: {resp.text[:300]}")
        if wait:
            self._wait_membership(url, present=True, timeout_s=timeout_s)

    def remove_worker(self, url: str, *, wait: bool = True, timeout_s: float = 60.0) -> None:
        url = self._norm(url)
        workers = self.list_workers()
        if self._legacy_api:
            resp = self._call("POST", "/remove_worker", params={"url": url})
            if resp.status_code != 200:
                raise RouterError(f"POST {self.url}/remove_worker {url}: HTTP {resp.status_code}: {resp.text[:300]}")
        else:
            matches = [w for w in workers if self._norm(w.get("url", "")) == url]
            if not matches:
                raise RouterError(f"{url} is not a worker of the router at {self.url}")
            for w in matches:
                wid = w.get("id") or w.get("worker_id") or url
                resp = self._call("DELETE", f"/workers/{wid}")
                if resp.status_code not in (200, 202, 204):
                    raise RouterError(f"DELETE {self.url}/workers/{wid}: HTTP {resp.status_code}: {resp.text[:300]}")
        if wait:
            self._wait_membership(url, present=False, timeout_s=timeout_s)

    def _wait_membership(self, url: str, *, present: bool, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                workers = {self._norm(w.get("url", "")): w for w in self.list_workers()}
            except RouterError:  # an unreadable answer: asked again until the deadline
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                continue
            w = workers.get(url)
            if present and w is not None and w.get("is_healthy", True):
                return
            if not present and w is None:
                return
            if not self.is_alive():
                raise RouterError(f"the router exited\n--- log tail ---\n{self.log_tail()}")
            if time.monotonic() > deadline:
                state = "joined" if present else "left"
                raise RouterError(f"{url} has not {state} the router at {self.url} within {timeout_s:.0f}s")
            time.sleep(0.05)
