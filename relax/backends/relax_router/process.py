"""Start Relax's router (`relax.backends.relax_router.server`) as a child process and manage its workers,
with the Python interface of `relax.backends.sglang.router.RouterProcess` (the rollout manager uses
either, by `--use-slime-router`)."""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

from relax.wire.net import ManagedProcess, find_free_port, wait_http_ok
from relax.backends.relax_router.middleware import middleware_paths
from relax.backends.sglang.router import RouterError, RouterProcess


def build_relax_router_command(host: str, port: int, *, request_timeout_s: float, max_connections: int | None,
                               failure_threshold: int, health_interval_s: float, middleware_paths: Sequence[str],
                               tokenizer: str | None, parent_pid: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "relax.backends.relax_router.server", "--host", host, "--port", str(int(port)),
           "--request-timeout", repr(float(request_timeout_s)), "--max-connections", str(int(max_connections or 0)),
           "--failure-threshold", str(int(failure_threshold)), "--health-interval", repr(float(health_interval_s))]
    if middleware_paths:
        cmd += ["--middleware", *middleware_paths]
    if tokenizer:
        cmd += ["--tokenizer", str(tokenizer)]
    if parent_pid is not None:
        cmd += ["--parent-pid", str(int(parent_pid))]
    return cmd


class RelaxRouterProcess(RouterProcess):
    """Relax's router in a child process. The run's key reaches it through the environment (never the
    command line); membership goes through the same `/workers` API as sglang-router's."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        request_timeout_s: float = 600.0,
        max_connections: int | None = None,
        failure_threshold: int = 3,
        health_interval_s: float = 5.0,
        middleware_paths: Sequence[str] = (),
        tokenizer: str | None = None,
        worker_urls: Sequence[str] = (),
        log_path: str | None = None,
        control_timeout_s: float = 30.0,
        exit_with_parent: bool = True,
    ):
        self.host = host
        self.port = int(port) if port else find_free_port(host)
        self.policy = "prefix_affinity"
        self.request_timeout_s = control_timeout_s  # the deadline of this object's own calls to the router
        self._legacy_api = False
        self._initial_workers = list(worker_urls)  # joined once the router answers, as sglang-router's --worker-urls
        cmd = build_relax_router_command(
            host, self.port, request_timeout_s=request_timeout_s, max_connections=max_connections,
            failure_threshold=failure_threshold, health_interval_s=health_interval_s,
            middleware_paths=middleware_paths, tokenizer=tokenizer,
            parent_pid=os.getpid() if exit_with_parent else None)
        ManagedProcess.__init__(self, cmd, log_path=log_path, name=f"relax-router-{self.port}")

    def start(self, timeout_s: float = 60.0) -> "RelaxRouterProcess":  # type: ignore[override]
        ManagedProcess.start(self)
        try:
            wait_http_ok(self.url + "/health", timeout_s, alive=self.is_alive)
        except (TimeoutError, RuntimeError) as exc:
            self.stop()
            raise RouterError(f"the Relax router did not start: {exc}\n--- log tail ---\n{self.log_tail()}") from None
        for url in self._initial_workers:
            self.add_worker(url)
        return self

    def evicted(self) -> dict[str, str]:
        """Workers the router removed after too many consecutive failures: url -> reason."""
        resp = self._call("GET", "/workers")
        if resp.status_code != 200:
            raise RouterError(f"GET {self.url}/workers: HTTP {resp.status_code}: {resp.text[:300]}")
        return {e["url"]: e["reason"] for e in self._json(resp, "/workers").get("evicted", [])}

    def remove_worker(self, url: str, *, wait: bool = True, timeout_s: float = 60.0) -> None:
        # A worker the router already removed for its failures is gone, as asked.
        if self._norm(url) in self.evicted():
            return
        super().remove_worker(url, wait=wait, timeout_s=timeout_s)


def router_from_config(config: Any, *, host: str, log_path: str | None,
                       default_max_connections: int) -> RelaxRouterProcess:
    """The router `--use-slime-router` asks for. `--slime-router-timeout` unset: the deadline is
    `--generate-timeout` (the client's own); `--slime-router-max-connections` unset: as many as the
    rollout keeps requests in flight (`default_max_connections`), so the router never queues them."""
    return RelaxRouterProcess(
        host=host, port=config.sglang_router_port,
        request_timeout_s=float(config.slime_router_timeout or config.generate_timeout),
        max_connections=config.slime_router_max_connections or default_max_connections,
        failure_threshold=config.slime_router_health_check_failure_threshold,
        middleware_paths=middleware_paths(config.slime_router_middleware_paths),
        tokenizer=config.hf_checkpoint, log_path=log_path)
