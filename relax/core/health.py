"""The HealthManager (--use-health-check): heartbeats of every Megatron rank and of the rollout manager, and probes
of the data plane's actors and the metrics service, so that a hung worker is told apart from a dead one and found
within --heartbeat-timeout instead of --train-step-timeout (or, for the rollout manager, whose step has no
deadline of its own, at all).

* Worker side (relax.observability.heartbeat): each Megatron rank (trainer, reference, teacher, critic: `relax.roles.megatron_rank.MegatronRank`)
  starts `start_heartbeat(self)` in its constructor, and the rollout manager (`relax.roles.rollout.
  RolloutManager`, one actor: role "rollout", rank None) `start_heartbeat(self, role="rollout")`: a daemon
  thread of its own that sends (role, rank, pid, node) to the run's `HeartbeatBoard` every --heartbeat-interval.
  It runs whatever the worker's main thread is doing, so a worker stuck in a call keeps beating, and a worker
  that stops beating is a stopped (SIGSTOP, frozen) or dead process.
* Actors without a heartbeat thread of their own (TransferQueue's controller and storage units, the metrics
  service) are probed by the driver instead (`ActorProbe`): a no-op call every --heartbeat-interval, whose
  answer counts as their beat; a stopped, dead or stuck one stops answering and is silent like a rank.
* Board: a small Ray actor (no CPU share) that records when each rank last beat, by its own clock. Its name
  is carried in the config's meta (`health_board`), a new one per attempt of the run, so that a rank of an
  earlier attempt can never be mistaken for one of the current attempt.
* Driver side: `HealthManager` polls the board from a thread and, through `relax.core.calls.set_watch`, every
  bounded wait of the controller (`wait_all`, `run_bounded`) checks it between slices: a rank silent for longer
  than --heartbeat-timeout ends the wait with a `RoleFailure` naming the role, rank, node and pid, the step and
  the call in progress, and what the process is (stopped: hung; gone: dead; running but silent), the same
  console line as every other failed call (relax.core.deadlines). A rank killed outright is usually reported
  sooner by Ray itself (the call raises ActorDiedError); either way the restart ladder of
  `relax.core.health_restart` decides what happens next.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, Optional, Sequence

import psutil
import ray

from relax.config.errors import ConfigError
from relax.config.rules_training import heartbeat_error
from relax.core.deadlines import Call, RoleFailure
from relax.observability.heartbeat import BOARD_META, HeartbeatBoard, worker_name

logger = logging.getLogger("relax")


class WorkerSilent(RuntimeError):
    """The cause of a `RoleFailure` for a rank whose heartbeats stopped."""


# The Megatron roles, whose ranks a restart can replace alone (relax.core.health_restart)
MEGATRON_ROLES = frozenset({"trainer", "reference", "teacher", "critic"})


# ============================================================================ driver side
def _whoami(actor: Any) -> tuple[int, str]:
    return os.getpid(), ray.util.get_node_ip_address()


def _answer(actor: Any) -> None:
    return None


class ActorProbe:
    """Liveness of one actor that sends no heartbeats: a no-op call (`__ray_call__`) at most every interval, one
    at a time. Its answer is the beat; an actor that is stopped (SIGSTOP) or dead never answers, and one stuck in a
    call answers late (Ray runs an actor's calls one at a time): either way it falls silent. The actors probed
    this way (TransferQueue's, the metrics service) serve their work on threads of their own, and answer their
    Ray calls at once."""

    def __init__(self, name: str, handle: Any):
        self.name, self.handle = name, handle
        self.pid: int | None = None
        self.node = ""
        self.answered = time.monotonic()  # counted from the start of the watch
        self._who = handle.__ray_call__.remote(_whoami)
        self._pending: Any = None
        self._sent = 0.0

    def poll(self, interval_s: float) -> None:
        if self._who is not None:
            ready, _ = ray.wait([self._who], timeout=0)
            if ready:
                try:
                    self.pid, self.node = ray.get(self._who)
                except Exception:  # dead before its first answer: it stays silent
                    pass
                self._who = None
        if self._pending is not None:
            ready, _ = ray.wait([self._pending], timeout=0)
            if not ready:
                return
            try:
                ray.get(self._pending)
                self.answered = time.monotonic()
            except Exception:  # dead: no answer counts
                pass
            self._pending = None
        if time.monotonic() - self._sent >= interval_s:
            self._sent = time.monotonic()
            self._pending = self.handle.__ray_call__.remote(_answer)

    def entry(self) -> dict[str, Any] | None:
        """Its board entry (rank None), once its pid is known."""
        if self.pid is None:
            return None
        return {"role": self.name, "rank": None, "pid": self.pid, "node": self.node,
                "age_s": time.monotonic() - self.answered}


def new_board_name() -> str:
    return f"relax-health-{uuid.uuid4().hex[:12]}"


def process_state(pid: int, node: str, here: str) -> str:
    """What a silent rank's process is, as a clause: only a process on this node can be looked at."""
    if node != here:
        return f"pid {pid} on {node} (another node: dead or hung)"
    try:
        proc = psutil.Process(pid)
        status = proc.status()
    except psutil.NoSuchProcess:
        return f"process {pid} is gone (dead)"
    except psutil.Error:
        return f"process {pid} cannot be inspected"
    if status == psutil.STATUS_STOPPED:
        return f"process {pid} is stopped (hung)"
    if status == psutil.STATUS_ZOMBIE:
        return f"process {pid} has exited (dead)"
    return f"process {pid} is {status} but silent (hung)"


def silent_entries(latest: list[dict[str, Any]], since_poll_s: float, timeout_s: float,
                   probed: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Board entries (with `age_s` as of a poll `since_poll_s` ago), and `probed` entries (aged already), silent for
    longer than `timeout_s`, with their `age_s` brought up to now."""
    return [e for e in aged_entries(latest, since_poll_s) + list(probed) if e["age_s"] > timeout_s]


def aged_entries(latest: list[dict[str, Any]], since_poll_s: float) -> list[dict[str, Any]]:
    """Board entries with their `age_s` (as of a poll `since_poll_s` ago) brought up to now."""
    return [{**e, "age_s": e["age_s"] + since_poll_s} for e in latest]


def silent_failure(entry: dict[str, Any], timeout_s: float, here: str, calls: list[Call]) -> RoleFailure:
    """The failure of a silent worker: its own call among `calls` (those still running; the rollout manager's
    calls have rank None, as its heartbeats), else a heartbeat clause at the step of the call the driver waits
    for."""
    state = process_state(entry["pid"], entry["node"], here)
    cause = WorkerSilent(f"no heartbeat for {entry['age_s']:.1f} s (--heartbeat-timeout {timeout_s:g}): {state}")
    address = f"{entry['node']} pid {entry['pid']}"
    mine = [c for c in calls if c.role == entry["role"] and c.rank == entry["rank"]]
    if mine:  # the controller's calls into the rollout manager carry no address: its heartbeats give one
        return RoleFailure(mine[0] if mine[0].address else replace(mine[0], address=address), cause)
    action = f"heartbeat (while waiting for {calls[0].action})" if calls else "heartbeat"
    call = Call(entry["role"], action, rank=entry["rank"], address=address, step=calls[0].step if calls else None)
    return RoleFailure(call, cause)


class HealthManager:
    """The driver's view of the attempt's heartbeats (see the module docstring)."""

    probes: list[ActorProbe] | tuple = ()  # actors without heartbeats of their own (`watch_actors`)

    def __init__(self, config: Any):
        self.name = config.meta[BOARD_META]
        self.interval_s = float(config.heartbeat_interval)
        self.timeout_s = float(config.heartbeat_timeout)
        error = heartbeat_error(self.interval_s, self.timeout_s)  # parse_config refuses these before Ray
        if error:
            raise ConfigError(error)
        self.here = ray.util.get_node_ip_address()
        self.board = HeartbeatBoard.options(name=self.name, lifetime=None).remote()
        self.latest: list[dict[str, Any]] = []
        self.probes = []
        self.polled_at = 0.0  # monotonic time of the last answer of the board
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="relax-health", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        period = min(self.interval_s, 1.0)
        while not self._stop.is_set():
            for probe in self.probes:
                probe.poll(self.interval_s)
            try:
                self.latest = ray.get(self.board.snapshot.remote(), timeout=max(5.0, self.timeout_s))
                self.polled_at = time.monotonic()
            except Exception as exc:  # the board is stopping with the attempt; a late poll is not a failure
                if self._stop.is_set():
                    return
                logger.debug("health: board poll failed: %r", exc)
            self._stop.wait(period)

    def watch_actors(self, named: dict[str, Any]) -> None:
        """Also watch actors that send no heartbeats of their own (TransferQueue's controller and storage units,
        the metrics service), by name: each answers a no-op call every --heartbeat-interval (`ActorProbe`), and
        one that has not answered for --heartbeat-timeout is silent, as a rank whose beats stopped."""
        for name, handle in named.items():
            self.probes.append(ActorProbe(name, handle))

    def _since_poll(self) -> tuple[list[dict[str, Any]], float]:
        """The board's entries as of its last poll (none before the first), and the seconds since."""
        return (self.latest, time.monotonic() - self.polled_at) if self.polled_at else ([], 0.0)

    def _probed(self) -> list[dict[str, Any]]:
        return [e for e in (p.entry() for p in self.probes) if e is not None]

    def _entries(self) -> list[dict[str, Any]]:
        """The board's entries (aged since its last poll) and the probed actors' (aged to now)."""
        return aged_entries(*self._since_poll()) + self._probed()

    def silent(self) -> list[dict[str, Any]]:
        """The workers whose last heartbeat (or probe answer) is older than --heartbeat-timeout."""
        return silent_entries(*self._since_poll(), self.timeout_s, self._probed())

    def watch(self, calls: list[Call]) -> None:
        """Raise a `RoleFailure` for the first silent rank (relax.core.calls calls this between wait slices)."""
        silent = self.silent()
        if silent:
            raise silent_failure(silent[0], self.timeout_s, self.here, calls)

    def describe(self, role: str, rank: Optional[int]) -> str:
        """What the heartbeats say of a worker whose call ran past its deadline: still beating means its process
        is alive and the call itself is stuck (hung in the call); silent means stopped or dead."""
        who = worker_name(role, rank)
        for e in self._entries():
            if e["role"] == role and e["rank"] == rank:
                if e["age_s"] <= self.timeout_s:
                    return f"{who} is alive (last heartbeat {e['age_s']:.1f} s ago): hung in its call"
                return f"{who}: {process_state(e['pid'], e['node'], self.here)}"
        return f"{who} never sent a heartbeat"

    def lost_ranks(self) -> list[tuple[str, str]]:
        """(who, state) of this attempt's ranks on this node whose process is gone or stopped: after a failure
        they name the rank that caused it (a collective's peers fail too when one rank dies)."""
        lost = []
        for e in self._entries():
            state = process_state(e["pid"], e["node"], self.here) if e["node"] == self.here else ""
            if "(dead)" in state or "stopped" in state:
                lost.append((worker_name(e["role"], e["rank"]), state))
        return lost

    def pid_of(self, role: str, rank: Optional[int]) -> Optional[tuple[int, str]]:
        """(pid, node) of a worker from its heartbeats (rank None: the rollout manager), None before its first
        beat."""
        for entry in self.latest:
            if entry["role"] == role and entry["rank"] == rank:
                return entry["pid"], entry["node"]
        return None

    def forget(self, roles: frozenset[str]) -> None:
        """A restart replaced the ranks of `roles`: their old heartbeats no longer count (the board's and the last
        poll's); each new rank is watched from its first beat."""
        ray.get(self.board.forget.remote(sorted(roles)), timeout=max(5.0, self.timeout_s))
        self.latest = [e for e in self.latest if e["role"] not in roles]

    def kill_silent_ranks(self) -> list[int]:
        """SIGKILL this attempt's silent ranks on this node: a SIGSTOPped process cannot act on Ray's request to
        exit, and neither a restart nor the shutdown should wait for it. Returns the pids signalled."""
        killed = []
        for entry in self.silent():
            if entry["node"] != self.here:
                continue
            try:
                os.kill(entry["pid"], signal.SIGKILL)
                killed.append(entry["pid"])
            except (ProcessLookupError, PermissionError):
                pass
        return killed

    def close(self) -> None:
        self._stop.set()
        try:
            ray.kill(self.board)
        except Exception:
            pass
        self._thread.join(timeout=2.0)
