"""Rollout engine role: one Ray actor per engine, owning the server process behind SGLang's HTTP API."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import ray

from relax.backends.embedded.launcher import EmbeddedServerProcess
from relax.backends.sglang.server import SGLangServerProcess

logger = logging.getLogger(__name__)


def engine_bind_host() -> str:
    """Where an engine listens: loopback while the whole Ray cluster is this one node (nothing else needs
    to reach it), the node's address only when roles span nodes. Either way its control endpoints need
    the run's key (relax.backends.auth)."""
    if not ray.is_initialized():
        return "127.0.0.1"
    alive = [node for node in ray.nodes() if node.get("Alive")]
    return ray.util.get_node_ip_address() if len(alive) > 1 else "127.0.0.1"


PORT_TAKEN = "address already in use"
PORT_ATTEMPTS = 3


def start_with_port_retry(make, timeout_s: float):
    """Start the server `make()` builds and wait until it is healthy. Its port is found free before the
    server binds it, so another process can take it in between (seen on a busy machine: "[Errno 98] ...
    address already in use"); then a new server with a new port is tried, up to PORT_ATTEMPTS in all."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        process = make()
        process.start()
        try:
            return process.wait_healthy(timeout_s) or process
        except Exception as exc:
            process.stop()
            if attempt == PORT_ATTEMPTS or PORT_TAKEN not in str(exc).lower():
                raise
            logger.warning("engine port %d was taken before the server bound it; trying another", process.port)


@ray.remote
class EngineActor:
    """Starts an engine server in a child process and reports its URL; stops it on `shutdown`."""

    def __init__(self, backend: str, model_path: str, server_args: dict[str, Any], tp_size: int = 1,
                 log_dir: str | None = None, engine_id: int = 0):
        self.backend = backend
        self.model_path = model_path
        self.server_args = dict(server_args)
        self.tp_size = tp_size
        self.log_path = os.path.join(log_dir, f"engine-{engine_id}.log") if log_dir else None
        self.process = None

    def start(self, timeout_s: float = 300.0) -> str:
        host = engine_bind_host()

        def make():
            if self.backend == "embedded":
                return EmbeddedServerProcess(self.model_path, host=host, server_args=self.server_args,
                                             log_path=self.log_path)
            return SGLangServerProcess(self.model_path, host=host, tp_size=self.tp_size,
                                       server_args=self.server_args, log_path=self.log_path)

        self.process = start_with_port_retry(make, timeout_s)
        return self.process.url

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def restart(self, timeout_s: float = 300.0) -> str:
        """A fresh server on this actor's devices (its placement bundle), from the model it was started with;
        the old one is killed first. Returns the new URL (a new port)."""
        self.kill_server()
        return self.start(timeout_s)

    def kill_server(self) -> None:
        """SIGKILL the server's process group at once: a hung (even SIGSTOPped) server dies, and the router's
        connections to it break, so the requests it held fail now and are sent again elsewhere."""
        if self.process is None:
            return
        if self.process.is_alive():
            self.process._signal_group(signal.SIGKILL)
        self.process.stop(timeout_s=5.0)
        self.process = None

    def signal_server(self, sig: int) -> None:
        """Send `sig` to the server's process group (test fault injection: SIGKILL, SIGSTOP)."""
        if self.process is not None and self.process.is_alive():
            self.process._signal_group(sig)

    def shutdown(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
