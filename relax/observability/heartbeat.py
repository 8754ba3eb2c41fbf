"""The worker side of --use-health-check's heartbeats (relax.core.health has the driver side).

Each Megatron rank and the rollout manager start `start_heartbeat` in their constructor: a daemon thread of
its own that sends (role, rank, pid, node) to the attempt's `HeartbeatBoard` every --heartbeat-interval. It runs
whatever the worker's main thread is doing, so a worker stuck in a call keeps beating, and a worker that stops
beating is a stopped (SIGSTOP, frozen) or dead process. It sits below the roles and the controller, which
both use it: the roles start the thread, the controller's HealthManager reads the board.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Optional

import ray

logger = logging.getLogger("relax")
BOARD_META = "health_board"  # config.meta key: the name of the attempt's HeartbeatBoard actor
LOOKUP_S = 60.0  # how long a rank looks for the board (it is created before the ranks, normally found at once)


@ray.remote(num_cpus=0)
class HeartbeatBoard:
    """When each (role, rank) last beat, by this actor's monotonic clock, with its pid and node."""

    def __init__(self):
        self.seen: dict[tuple[str, int], dict[str, Any]] = {}

    def beat(self, role: str, rank: Optional[int], pid: int, node: str) -> None:
        self.seen[(role, rank)] = {"role": role, "rank": rank, "pid": pid, "node": node, "t": time.monotonic()}

    def forget(self, roles: list[str]) -> None:
        """Drop the entries of `roles` (their ranks were replaced; the new ones beat under the same names)."""
        self.seen = {key: entry for key, entry in self.seen.items() if entry["role"] not in roles}

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{**entry, "age_s": now - entry["t"]} for entry in self.seen.values()]


# ============================================================================ worker side
def _role_of(worker: Any) -> str:
    # ReferenceWorker sets `role` ("reference" or "teacher") after the base constructor has run: read it per beat.
    return getattr(worker, "role", None) or type(worker).__name__.replace("Worker", "").lower()


def worker_name(role: str, rank: Optional[int]) -> str:
    """A worker as failures and the restart count name it: "trainer rank 1", or "rollout" for a single actor."""
    return role if rank is None else f"{role} rank {rank}"


def start_heartbeat(worker: Any, role: Optional[str] = None) -> Optional[threading.Thread]:
    """Start the heartbeat thread of a worker (`worker.config`) when the run has --use-health-check; None
    otherwise. `role` None: a Megatron rank (`worker.rank`, its role from the worker); else a role of one actor
    (the rollout manager: "rollout"), which beats with rank None, as the controller's calls into it name it."""
    config = worker.config
    name = config.meta.get(BOARD_META) if config.use_health_check else None
    if not name:
        return None
    interval = float(config.heartbeat_interval)
    node = ray.util.get_node_ip_address()
    pid = os.getpid()

    def run() -> None:
        board = None
        deadline = time.monotonic() + LOOKUP_S
        while board is None:
            try:
                board = ray.get_actor(name)
            except ValueError:  # not registered yet
                if time.monotonic() > deadline:
                    logger.warning("heartbeat: no board %s after %.0f s; this worker sends none", name, LOOKUP_S)
                    return
                time.sleep(0.2)
        while True:
            try:
                if role is None:
                    board.beat.remote(_role_of(worker), worker.rank, pid, node)
                else:
                    board.beat.remote(role, None, pid, node)
            except Exception:  # the board is gone: the attempt is over
                return
            time.sleep(interval)

    thread = threading.Thread(target=run, name="relax-heartbeat", daemon=True)
    thread.start()
    return thread
