"""The liveness watch of the rollout engines (--engine-liveness-timeout, on by default; 0 switches it off).

While a rollout step or an evaluation has requests in flight, every active engine of the pool is probed with the
health monitor's probe (`relax.rollout.engine_pool.probe_engine`, /health_generate: an engine that generates
answers at once, an idle one after a one-token generation) every few seconds. An engine that answers nothing for
the timeout is named on the console (a WARNING of the rollout manager), then:

* with --use-fault-tolerance it goes the health monitor's way (`EnginePool.on_failure`): off the router, killed,
  replaced and re-synced, its requests sent again to the others; the step goes on;
* without it the step's call raises `EngineUnresponsive` at once, naming the engine, its address and the step,
  and the run stops with exit 1 (the controller reports the rollout role's error as for any failed call). The
  engine's server is then killed, so that the router and the rollout function, left behind in its thread, let
  go of its requests; the run is ending, and the shutdown stops the manager and everything else.

The step runs in a thread of its own (`run`) so that the call can return while the rollout function waits on a
request (up to --generate-timeout); this holds for any --rollout-function-path, asyncio or not.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

import ray

from relax.rollout.engine_pool import ACTIVE, Engine, EnginePool, probe_engine
from relax.rollout.liveness import EngineUnresponsive, LivenessWatch, Silence

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 5.0  # between two probes of one engine (at most a quarter of the timeout)
TICK_S = 0.5  # how often the watch looks at its probes' answers


class EngineWatcher:
    """The watch over `pool`'s active engines. `probe(url, timeout_s) -> bool` is the health monitor's probe; a
    probe may take up to the whole timeout (an engine that answers slowly is alive)."""

    def __init__(self, pool: EnginePool, timeout_s: float, *, interval_s: Optional[float] = None,
                 probe: Callable[[str, float], bool] = probe_engine, tick_s: float = TICK_S):
        self.pool = pool
        self.watch = LivenessWatch(timeout_s, interval_s if interval_s is not None
                                   else min(PROBE_INTERVAL_S, timeout_s / 4))
        self.probe = probe
        self.tick_s = tick_s
        self.failure: Optional[EngineUnresponsive] = None  # without --use-fault-tolerance: what stops the run
        self.found: list[Silence] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "EngineWatcher":
        self._thread = threading.Thread(target=self._loop, name="relax-engine-liveness", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=wait_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.check()
            except Exception as exc:  # a bad round must never end the watch
                logger.warning("engine liveness watch: %r", exc)

    def check(self) -> list[Silence]:
        """One look: probes sent where due, silent engines handled. Returns those found now."""
        if not self.watch.in_flight:
            return []
        if self.pool.released or self.pool.pushing:  # answers may be late by design (as for the health monitor)
            self.watch.hold()
            return []
        with self.pool.lock:
            engines = {e.url: e for e in self.pool.engines.values() if e.state == ACTIVE and e.url}
        self.watch.forget(set(engines))
        urls = list(engines)
        for url in self.watch.to_probe(urls):
            threading.Thread(target=self._probe, args=(url,), name="relax-engine-liveness-probe", daemon=True).start()
        found = self.watch.silent(urls)
        for silence in found:
            self.found.append(silence)
            self._act(engines[silence.url], silence)
        return found

    def _probe(self, url: str) -> None:
        answered = False
        try:
            answered = self.probe(url, self.watch.timeout_s)
        finally:
            self.watch.probed(url, answered)

    def _act(self, e: Engine, silence: Silence) -> None:
        what = (f"engine {e.id} ({e.url}) has answered neither its requests nor /health_generate for "
                f"{silence.silent_s:.0f} s (--engine-liveness-timeout {self.watch.timeout_s:g}) during "
                f"{silence.during}: it is stopped or hung")
        self.pool.event("engine_unresponsive", engine=e.id, url=e.url, silent_s=round(silence.silent_s, 2),
                        during=silence.during)
        if self.pool.on_failure is not None:  # --use-fault-tolerance: the health monitor replaces it
            logger.warning("%s; replacing it (--use-fault-tolerance)", what)
            self.pool.on_failure(e, f"no answer for {silence.silent_s:.0f} s with requests in flight "
                                    "(--engine-liveness-timeout)")
            return
        logger.warning("%s; stopping the run (--use-fault-tolerance would replace it)", what)
        if self.failure is None:
            self.failure = EngineUnresponsive(f"{what} (--use-fault-tolerance replaces such an engine; "
                                              "--engine-liveness-timeout 0 switches the watch off)")
        self._kill(e)

    def _kill(self, e: Engine) -> None:
        """The silent engine's server is killed (SIGKILL acts on a stopped process too) once the step has its
        error: the router lets go of the requests it holds, so the run's shutdown does not wait on them (a router
        with requests out to a stopped engine ignores SIGTERM). An engine Relax did not start is left alone."""
        if e.actor is None:
            return
        try:
            ray.get(e.actor.kill_server.remote(), timeout=self.pool.control_timeout_s)
        except Exception as exc:  # the actor may be gone already: the shutdown kills what is left
            logger.info("engine liveness watch: killing the server of engine %d: %r", e.id, exc)

    def run(self, fn: Callable[[], Any], during: str) -> Any:
        """`fn()` with requests in flight for `during` (e.g. `rollout step 3`): its result, or its error, or
        EngineUnresponsive as soon as the watch finds a silent engine it cannot replace."""
        self.watch.begin(during)
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def target() -> None:
            try:
                outcome["value"] = fn()
            except BaseException as exc:  # handed to the caller's thread below
                outcome["error"] = exc
            finally:
                done.set()

        threading.Thread(target=target, name=f"relax-{during.replace(' ', '-')}", daemon=True).start()
        try:
            while not done.wait(self.tick_s):
                if self.failure is not None:
                    raise self.failure
        finally:
            self.watch.end(during)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]
