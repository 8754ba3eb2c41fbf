"""The reward server's health (--rm-type remote_rm at --rm-url, with --use-fault-tolerance).

The reward server is the user's process: Relax did not start it and cannot restart it. So a dead or hung one is
found, named, and waited for, and the step's reward requests are sent again once it answers; a server that
does not come back within the bound stops the run with one line, instead of training on rewards that failed
(scored 0.0 under --reward-error-policy zero) or failing sample after sample.

* Probe: a thread of the rollout manager GETs ``<scheme>://<host>:<port>/health`` of --rm-url every
  --rollout-health-check-interval seconds (every second at most while the server is down), each within
  --rollout-health-check-timeout. Any HTTP answer below 500 counts (a server without a /health route answers
  404, which still proves its process serves requests); a refused connection is a dead server, a connection
  that gets no reply in time a hung (stopped, frozen) one, a 5xx an unhealthy one. A reward request that fails
  is itself a probe: the server is probed at once, so a dead server is found by the first request that fails.
* Outage: the first failed probe logs one line naming the server, how long it has not answered and why
  (`does not answer /health for 1.6 s (hung: ...)`). Reward requests in flight are cancelled and held, new
  ones wait; once it answers again they are all sent again (each with a fresh --reward-timeout). Generation
  goes on meanwhile: only the rewards wait.
* Bound: a step waits at most --reward-timeout seconds for the server (counted from when a request first
  waited for it in this outage); then every held request raises `RewardServerLost`, which no
  --reward-error-policy turns into a 0.0 reward, and the run stops naming the server.
* A request that fails while the server answers its probe failed on its own (a 4xx, an unparsable reply, a
  reward past --reward-timeout): it follows --reward-error-policy as before.

Every change is a line of ``<output-dir>/reward_server.jsonl`` (`down`, `up`, `lost`, and a test's
`fault_injected`), with wall-clock times.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import socket
import ssl
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional
from urllib.parse import urlsplit

from relax.health_faults import RankFault, fault_from_env, listener_pid

logger = logging.getLogger(__name__)

MAX_HOLDS = 3  # outages one request may be held through before its failure follows --reward-error-policy
DOWN_PROBE_S = 1.0  # while the server is down it is probed at least this often (its return is found sooner)
ATTEMPT_META = "health_attempt"  # config.meta key of the run's attempt (relax.core.health_restart)

__all__ = ["RewardServerLost", "RewardServerWatch", "health_url", "probe", "watch_from_args"]


class RewardServerLost(RuntimeError):
    """The reward server did not answer within the bound: the run stops (no reward policy applies)."""


def health_url(url: str) -> str:
    """The health endpoint of the server that serves `url`: its scheme, host and port, path /health."""
    parts = urlsplit(url)
    return f"{parts.scheme or 'http'}://{parts.netloc}/health"


def probe(url: str, timeout_s: float) -> tuple[bool, str]:
    """(answers, why not) of one GET of `url`'s /health within `timeout_s`."""
    parts = urlsplit(health_url(url))
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    try:
        conn.request("GET", "/health")
        status = conn.getresponse().status
    except ConnectionRefusedError:
        return False, "dead: connection refused"
    except (ConnectionResetError, http.client.RemoteDisconnected):
        return False, "dead: connection reset"
    except ssl.SSLCertVerificationError:
        return True, ""  # the server's process answered the handshake: alive (its certificate is the requests' matter)
    except (socket.timeout, TimeoutError):
        return False, f"hung: it takes connections but sends no reply within {timeout_s:g} s"
    except (OSError, http.client.HTTPException) as exc:
        return False, f"unreachable: {type(exc).__name__}: {exc}"
    finally:
        conn.close()
    if status >= 500:
        return False, f"unhealthy: /health answers HTTP {status}"
    return True, ""


@dataclass
class Outage:
    """One stretch during which the server did not answer."""

    number: int
    last_ok: float  # monotonic time of the last answer before it
    found: float  # monotonic time it was found
    why: str
    waited_since: Optional[float] = None  # when a request first waited for the server in this outage
    held: int = 0  # requests held (cancelled in flight, or failed) to be sent again
    lost: Optional[RewardServerLost] = None


class _LoopSignal:
    """The server's state as seen from one event loop (a step's `asyncio.run`): `up` set while it answers, `down`
    while it does not. The probe thread flips them through the loop's `call_soon_threadsafe`."""

    def __init__(self, up: bool):
        self.up, self.down = asyncio.Event(), asyncio.Event()
        self.set(up)

    def set(self, up: bool) -> None:
        (self.up if up else self.down).set()
        (self.down if up else self.up).clear()


class RewardServerWatch:
    """See the module docstring. `probe_fn(url, timeout_s)` and `clock` are replaceable for tests."""

    def __init__(self, url: str, *, interval_s: float, timeout_s: float, bound_s: float,
                 log_path: Optional[str] = None, probe_fn: Callable[[str, float], tuple[bool, str]] = probe,
                 clock: Callable[[], float] = time.monotonic):
        self.url = url
        self.interval_s, self.timeout_s, self.bound_s = float(interval_s), float(timeout_s), float(bound_s)
        self.log_path = log_path
        self.probe_fn, self.clock = probe_fn, clock
        self.lock = threading.Lock()
        self.probe_lock = threading.Lock()  # one probe at a time; callers meanwhile take its answer
        self.last_ok = clock()
        self.probe_started = -1.0
        self.outage: Optional[Outage] = None  # the current one; None while the server answers
        self.outages = 0
        self.events: list[dict[str, Any]] = []
        # test-only (relax.health_faults, role=reward): several may be armed, each fires at its step once
        self.faults: list[RankFault] = []
        self.attempt = 0
        self._loops: "weakref.WeakKeyDictionary[Any, _LoopSignal]" = weakref.WeakKeyDictionary()
        self._stop = threading.Event()
        self._wake = threading.Event()  # an outage found by a request: probe at the down cadence from now
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ state
    @property
    def up(self) -> bool:
        return self.outage is None

    def observe(self, ok: bool, why: str = "") -> None:
        """Record one probe's answer: the transitions log their line and wake the waiting requests."""
        now = self.clock()
        with self.lock:
            if ok:
                self.last_ok = now
                outage, self.outage = self.outage, None
                if outage is None:
                    return
                down_s = now - outage.found
                logger.warning("reward server %s answers /health again after %.1f s: sending its %d held reward "
                               "request(s) again", self.url, down_s, outage.held)
                self._event("up", down_s=round(down_s, 3), held=outage.held)
            else:
                if self.outage is not None:
                    self.outage.why = why  # the latest reason (a reset while it dies, then refused)
                    return
                self.outages += 1
                self.outage = Outage(self.outages, self.last_ok, now, why)
                silent = now - self.last_ok
                logger.warning("reward server %s does not answer /health for %.1f s (%s): reward requests wait for "
                               "it, at most --reward-timeout %g s, and are sent again once it answers",
                               self.url, silent, why, self.bound_s)
                self._event("down", silent_s=round(silent, 3), why=why)
        if not ok:
            self._wake.set()
        self._notify(ok)

    def check(self) -> bool:
        """Probe now (or take the answer of a probe that ran meanwhile); True when the server answers."""
        asked = self.clock()
        with self.probe_lock:
            if self.probe_started < asked:  # only a probe sent after the question answers it
                self.probe_started = self.clock()
                self.observe(*self.probe_fn(self.url, self.timeout_s))
            return self.up

    def lost_error(self) -> Optional[RewardServerLost]:
        """The failure once a request has waited `bound_s` for the server in this outage, else None."""
        with self.lock:
            outage = self.outage
            if outage is None:
                return None
            if outage.lost is None:
                now = self.clock()
                if outage.waited_since is None:
                    outage.waited_since = now
                if now - outage.waited_since < self.bound_s:
                    return None
                outage.lost = RewardServerLost(
                    f"reward server {self.url} does not answer /health for {now - outage.last_ok:.1f} s "
                    f"({outage.why}); the step waited {now - outage.waited_since:.0f} s for it (--reward-timeout "
                    f"{self.bound_s:g}); Relax did not start it and cannot restart it: bring it back, then resume "
                    f"the run (--load)")
                self._event("lost", silent_s=round(now - outage.last_ok, 3), held=outage.held)
            return outage.lost

    def _event(self, kind: str, **info: Any) -> None:
        record = {"event": kind, "url": self.url, "time": time.time(), **info}
        self.events.append(record)
        if self.log_path:
            try:
                with open(self.log_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as exc:
                logger.debug("reward server events: %s not written: %r", self.log_path, exc)

    # ------------------------------------------------------------------ probe thread
    def start(self) -> "RewardServerWatch":
        self._thread = threading.Thread(target=self._run, name="relax-reward-server-watch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            self._wake.wait(self.interval_s if self.up else min(self.interval_s, DOWN_PROBE_S))
            self._wake.clear()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    # ------------------------------------------------------------------ the requests' side
    def _signal(self) -> _LoopSignal:
        loop = asyncio.get_running_loop()
        with self.lock:
            signal = self._loops.get(loop)
            if signal is None:
                signal = self._loops[loop] = _LoopSignal(self.up)
        return signal

    def _notify(self, up: bool) -> None:
        with self.lock:
            loops = list(self._loops.items())
        for loop, signal in loops:
            try:
                loop.call_soon_threadsafe(signal.set, up)
            except RuntimeError:  # that step's loop is closed
                pass

    async def _until_up(self, signal: _LoopSignal) -> None:
        while not signal.up.is_set():
            lost = self.lost_error()
            if lost is not None:
                raise lost
            try:
                await asyncio.wait_for(signal.up.wait(), min(1.0, self.bound_s))
            except asyncio.TimeoutError:
                pass

    def _hold(self) -> None:
        with self.lock:
            if self.outage is not None:
                self.outage.held += 1

    async def call(self, make: Callable[[], Awaitable[Any]], step: Optional[int] = None) -> Any:
        """`await make()` (one reward request, with its own deadline) while the server answers: held while it
        does not, sent again once it does; `RewardServerLost` past the bound."""
        signal = self._signal()
        self._maybe_fire(step)
        holds = 0
        while True:
            await self._until_up(signal)
            outages = self.outages
            task = asyncio.ensure_future(make())
            if holds < MAX_HOLDS:  # past that, a request in flight waits out its own deadline
                went_down = asyncio.ensure_future(signal.down.wait())
                try:
                    await asyncio.wait({task, went_down}, return_when=asyncio.FIRST_COMPLETED)
                except BaseException:
                    task.cancel()
                    raise
                finally:
                    went_down.cancel()
                if not task.done():  # the server went down under it: sent again once it is back
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    holds += 1
                    self._hold()
                    continue
            try:
                return await task
            except Exception as exc:
                if holds >= MAX_HOLDS or isinstance(exc, RewardServerLost):
                    raise
                # the failed request is a probe: ask the server at once (a dead one is found by its first failure)
                answers = await asyncio.get_running_loop().run_in_executor(None, self.check)
                if answers and self.outages == outages:
                    raise  # the server answers and was never down meanwhile: the request failed on its own
            holds += 1
            self._hold()

    # ------------------------------------------------------------------ test-only fault injection
    def _maybe_fire(self, step: Optional[int]) -> None:
        if step is None:
            return
        for fault in self.faults:
            if self.attempt < fault.times and fault.matches("reward", "reward", step, self.attempt):
                self._fire(fault, step)

    def _fire(self, fault: RankFault, step: int) -> None:
        pid = fault.pid or listener_pid(self.url)
        if pid is None:
            fault.fired.append({"attempt": self.attempt, "pid": None, "t": None})
            logger.warning("test fault injection: no local process listens at %s; not fired", self.url)
            return
        fault.fire(pid, self.attempt, now=True)
        self._event("fault_injected", fault=fault.kind, step=step, pid=pid, resume_s=fault.resume_s)


# one watch per reward server and process: the step's and the evaluation's reward runners share it
_WATCHES: dict[str, RewardServerWatch] = {}
_WATCHES_LOCK = threading.Lock()


def watch_from_args(args: Any, rm_type: Optional[str] = None) -> Optional[RewardServerWatch]:
    """The process's watch of --rm-url (reward type remote_rm or boxed_remote_rm, with --use-fault-tolerance),
    started on first use; None otherwise. A test's RELAX_TEST_TRAINER_FAULT with role=reward is armed on it."""
    url = getattr(args, "rm_url", None)
    rm_type = str(rm_type or getattr(args, "rm_type", None) or "")
    if not (url and getattr(args, "use_fault_tolerance", False) and rm_type.endswith("remote_rm")):
        return None
    with _WATCHES_LOCK:
        watch = _WATCHES.get(url)
        if watch is None:
            watch = _WATCHES[url] = _new_watch(args, url)
    return watch


def _new_watch(args: Any, url: str) -> RewardServerWatch:
    out = getattr(args, "output_dir", None)
    log_path = str(Path(out) / "reward_server.jsonl") if out else None
    if log_path:
        os.makedirs(out, exist_ok=True)
    watch = RewardServerWatch(url, interval_s=float(args.rollout_health_check_interval),
                              timeout_s=float(args.rollout_health_check_timeout),
                              bound_s=float(args.reward_timeout or "inf"), log_path=log_path)
    fault = fault_from_env()
    if fault is not None and fault.role == "reward":
        watch.faults.append(fault)
    watch.attempt = int((getattr(args, "meta", None) or {}).get(ATTEMPT_META, 0))
    return watch.start()
