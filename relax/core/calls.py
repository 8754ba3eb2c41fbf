"""How the controller calls into its roles and stops them without ever blocking for good.

- `wait_all`: the results of calls into actors (one per rank), waited for in short slices so that SIGTERM
  and SIGINT act at once (the signal handler's KeyboardInterrupt is raised between slices, never queued
  behind a busy actor); the first error raises as soon as it is known, and a call past its deadline raises,
  naming every rank that has not answered.
- `run_bounded`: the same for a synchronous call made on the driver (data plane, auxiliary role groups,
  checkpoint saves), run in a daemon thread.
- `set_watch`: a check run between the slices of every such wait (the HealthManager's heartbeats,
  relax.core.health), so that a silent rank ends the wait by name long before the call's deadline.
- `stop_processes`: at shutdown, whatever the run started that is still there (a SIGSTOPped engine cannot act
  on its parent's death) gets SIGCONT and SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Sequence

import psutil
import ray

from relax.core.deadlines import Call, RoleFailure

logger = logging.getLogger("relax")
trace_log = logging.getLogger("relax.trace")

POLL_S = 0.25  # how often a wait wakes up: the latency of SIGTERM/SIGINT while a call is running

# `watch(calls)` raises a RoleFailure when a role is known to be dead or hung (None: nothing watches). One per
# driver process: the run's controller sets it for an attempt and clears it before its shutdown waits.
_watch: Callable[[list[Call]], None] | None = None


def set_watch(watch: Callable[[list[Call]], None] | None) -> None:
    global _watch
    _watch = watch


def _check_watch(calls: list[Call]) -> None:
    watch = _watch
    if watch is not None:
        watch(calls)


def wait_all(refs: Sequence[Any], calls: Sequence[Call], *, deadline_s: float | None, flag: str) -> list[Any]:
    """Results of `refs` (Ray object refs, `calls[i]` describing refs[i]) in order.

    Raises `RoleFailure` for the first call that raised (as soon as it is known; the other calls are left to
    the shutdown), or, once `deadline_s` has passed, for the calls still running. None: no deadline."""
    refs = list(refs)
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    start = time.monotonic()
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
        for ref in ready:
            i = index[ref]
            try:
                results[i] = ray.get(ref)
            except Exception as exc:
                raise RoleFailure(calls[i], exc) from exc
        if pending and deadline_s is not None and time.monotonic() - start > deadline_s:
            late = [calls[index[r]] for r in pending]
            raise RoleFailure(late[0], timeout_s=deadline_s, flag=flag, waiting=late)
        if pending:
            _check_watch([calls[index[r]] for r in pending])
    return results


class BoundedCall:
    """`fn()` running in a daemon thread since `start_bounded`; `wait()` waits for it in short slices (signals act
    at once) and returns its value. An error it raised is re-raised as a `RoleFailure` naming `call`, and so is a
    call past `deadline_s` from its start (the thread is left behind: the run is stopping, and the shutdown kills
    what it was waiting for)."""

    def __init__(self, fn: Callable[[], Any], call: Call, deadline_s: float | None, flag: str):
        self.call, self.deadline_s, self.flag = call, deadline_s, flag
        self._box: dict[str, Any] = {}

        def target() -> None:
            try:
                self._box["value"] = fn()
            except BaseException as exc:  # handed to the waiting thread
                self._box["error"] = exc

        self._thread = threading.Thread(target=target, name=f"relax-{call.action}", daemon=True)
        self._start = time.monotonic()
        self._thread.start()

    def wait(self) -> Any:
        thread, call = self._thread, self.call
        while thread.is_alive():
            thread.join(POLL_S)
            if thread.is_alive() and self.deadline_s is not None and time.monotonic() - self._start > self.deadline_s:
                raise RoleFailure(call, timeout_s=self.deadline_s, flag=self.flag)
            if thread.is_alive():
                _check_watch([call])
        if "error" in self._box:
            error = self._box["error"]
            if isinstance(error, RoleFailure):
                raise error
            raise RoleFailure(call, error) from error
        return self._box.get("value")


def start_bounded(fn: Callable[[], Any], call: Call, *, deadline_s: float | None, flag: str) -> BoundedCall:
    """`fn()` started in a daemon thread, to be waited for with `.wait()` (see `BoundedCall`)."""
    return BoundedCall(fn, call, deadline_s, flag)


def run_bounded(fn: Callable[[], Any], call: Call, *, deadline_s: float | None, flag: str) -> Any:
    """`fn()` run in a daemon thread and waited for (see `BoundedCall`)."""
    return BoundedCall(fn, call, deadline_s, flag).wait()


def wait_quietly(refs: Sequence[Any], timeout_s: float) -> int:
    """Wait up to `timeout_s` for `refs` (shutdown calls) without raising; returns how many finished. Their
    errors go to the log file only."""
    refs = [r for r in refs if r is not None]
    if not refs:
        return 0
    try:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, timeout_s))
    except Exception as exc:  # Ray already gone
        trace_log.warning("shutdown wait: %r", exc)
        return 0
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except Exception as exc:
            trace_log.warning("a role's shutdown raised", exc_info=exc)
    return len(ready)


def run_quietly(fn: Callable[[], Any], timeout_s: float, what: str) -> bool:
    """`fn()` in a daemon thread for at most `timeout_s`; False when it raised or is still running."""
    try:
        run_bounded(fn, Call(role="shutdown", action=what), deadline_s=timeout_s, flag="--engine-control-timeout")
        return True
    except RoleFailure as exc:
        logger.warning("shutdown: %s", exc)
        trace_log.warning("shutdown: %s", what, exc_info=exc)
        return False


def descendants() -> list[psutil.Process]:
    """Every process started below this one (Ray's processes when this driver started Ray, and theirs:
    trainer ranks, engines, the router)."""
    try:
        return psutil.Process(os.getpid()).children(recursive=True)
    except psutil.Error:
        return []


def stop_processes(processes: Sequence[psutil.Process], grace_s: float = 3.0) -> list[str]:
    """End those of `processes` that are still there: SIGCONT (a stopped process cannot act on SIGTERM),
    SIGTERM, up to `grace_s` to exit, then SIGKILL. Returns the commands of those that had to be signalled."""
    alive, names = [], []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                names.append(" ".join(p.cmdline()[:4]) or p.name())
                alive.append(p)
        except psutil.Error:
            pass
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for p in alive:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=grace_s)
    return names
