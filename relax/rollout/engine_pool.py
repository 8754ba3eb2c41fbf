"""The one list of rollout engines: `EnginePool`, owned by the rollout manager actor.

Rollout (through the router), the weight push (the controller asks for `push_targets` before each push),
colocation (memory release/resume) and fault tolerance all read this pool; nothing else keeps a list of
engines. Each engine is an `Engine` record: its URL, its actor (None for --rollout-external engines), its
placement (a bundle of the rollout placement group, or a placement group of its own for an engine added
beyond the initial count), its state and the weight version it serves.

An engine joins in this order: start (from --hf-checkpoint) -> weights -> router. "Weights": the pool's
weight source (trainer rank 0, which keeps a host copy of the weights it pushed last, see
`TrainerWorker.push_kept_weights`) pushes them to the new engine alone, and the engine must then report the
pool's current weight version; only then is it registered with the router. Before the first push the
engines serve --hf-checkpoint and a new one matches them as it starts.

`HealthMonitor` (--use-fault-tolerance) probes every active engine's /health_generate every
--rollout-health-check-interval s, each probe within --rollout-health-check-timeout s, from
--rollout-health-check-first-wait s on. An engine that fails a probe leaves the router at once and its
server is killed (SIGKILL, also when it hangs): the router's connections to it break, so the requests it
held fail now and the rollout sends them again (`relax.rollout.generate.post_generate`'s failover window),
to the other engines. Then it is restarted on the same actor (its devices) and joins as above. Probes pause
while colocation has the engines' memory released (they would answer 503 by design) and during a weight push
(an engine taking weights may answer late); before a push, `push_targets` checks /health of each engine
itself, so a push never goes to an engine that died since the last probe. An engine that dies during a push
still fails the push (and the run), naming it.

Every change is an event (`events`), with wall-clock times: injected faults, failures found (and why),
replacements, additions, removals; the rollout manager reports them as step metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import ray
import requests

from relax.wire.engine_client import EngineClient

logger = logging.getLogger(__name__)

STARTING, SYNCING, ACTIVE, DRAINING, DEAD, STOPPED = "starting", "syncing", "active", "draining", "dead", "stopped"
SYNC_ATTEMPTS = 3  # a joining engine's weights are pushed again when the version moved on meanwhile
REPLACE_ATTEMPTS = 3
ADD_POLL_S = 0.2  # how often a starting engine's addition looks whether it is still wanted


class AddAbandoned(RuntimeError):
    """An engine's addition given up because the pool is closing or the caller cancelled it."""


@dataclass
class Engine:
    id: int
    actor: Any = None  # relax.roles.engine.EngineActor; None: an external engine Relax did not start
    url: Optional[str] = None
    placement: Any = None  # (placement group, bundle index) the actor runs on; None: anywhere
    own_group: Any = None  # a placement group made for this engine alone (removed with it)
    state: str = STARTING
    weight_version: Optional[str] = None
    started_at: float = field(default_factory=time.time)

    def info(self) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "state": self.state, "weight_version": self.weight_version,
                "external": self.actor is None, "own_placement_group": self.own_group is not None,
                "started_at": self.started_at}


def _newer(version: str, than: Optional[str]) -> bool:
    if than is None:
        return True
    try:
        return int(version) > int(than)
    except ValueError:
        return version != than


def probe_engine(url: str, timeout_s: float) -> bool:
    """One /health_generate probe of engine `url`: True when it answered 200 within `timeout_s`. The probe of the
    health monitor here and of the liveness watch (relax.rollout.engine_watch)."""
    client = EngineClient(url, timeout_s=timeout_s)
    try:
        return client.health_generate(timeout_s=timeout_s)
    finally:
        client.close()


class EnginePool:
    """`make_actor(engine_id, placement) -> actor` starts an EngineActor (the rollout manager knows the
    backend, model, server flags and options); `new_placement() -> (group, bundle)` reserves room for one
    more engine (None: schedule anywhere). Thread-safe: the rollout, the health monitor and the
    controller's calls use it at once."""

    def __init__(self, router: Any, *, make_actor: Optional[Callable[[int, Any], Any]] = None,
                 new_placement: Optional[Callable[[], Any]] = None, remove_placement: Optional[Callable] = None,
                 control_timeout_s: float = 60.0, start_timeout_s: float = 300.0, sync_timeout_s: float = 3600.0):
        self.router = router
        self.make_actor = make_actor
        self.new_placement = new_placement
        self.remove_placement = remove_placement
        self.control_timeout_s = float(control_timeout_s)
        self.stop_timeout_s = 30.0  # for an engine to stop by itself before it is killed (--scale-in-shutdown-timeout)
        self.start_timeout_s = float(start_timeout_s)
        self.sync_timeout_s = float(sync_timeout_s)
        self.lock = threading.RLock()
        self.engines: dict[int, Engine] = {}
        self.next_id = 0
        self.weight_version: Optional[str] = None  # what the last push gave every engine; None: --hf-checkpoint
        self.weight_source: Any = None  # trainer rank 0 (push_kept_weights)
        self.released: set[str] = set()  # memory tags colocation has released on every engine
        # when the weight push under way began (push_targets; set_weight_version ends it): an engine busy taking
        # weights may answer a probe late, which must not count as a failure (for at most sync_timeout_s, in
        # case the pusher never reports back)
        self.push_started: Optional[float] = None
        self.closing = False  # shutdown has begun: no engine is started any more
        self.events: list[dict[str, Any]] = []
        # what to do with an engine found dead outside the probes (before a push); set by the health monitor
        self.on_failure: Optional[Callable[[Engine, str], None]] = None

    # ------------------------------------------------------------------ reading
    def urls(self, states: tuple[str, ...] = (ACTIVE,)) -> list[str]:
        with self.lock:
            return [e.url for e in self.engines.values() if e.state in states and e.url]

    def list(self) -> list[dict[str, Any]]:
        with self.lock:
            return [e.info() for e in self.engines.values()]

    def by_url(self, url: str) -> Engine:
        with self.lock:
            for e in self.engines.values():
                if e.url == url:
                    return e
        raise KeyError(f"no engine {url} in the pool")

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"kind": kind, "time": time.time(), **fields}
        with self.lock:
            self.events.append(record)
        # failures and replacements are what an operator looks for in the rollout manager's log
        level = logging.WARNING if kind in ("engine_failed", "engine_replaced", "engine_replace_failed",
                                            "fault_injected") else logging.INFO
        logger.log(level, "engine pool: %s", " ".join(f"{k}={v}" for k, v in record.items()))
        return record

    def _client(self, url: str, timeout_s: Optional[float] = None) -> EngineClient:
        return EngineClient(url, timeout_s=timeout_s or self.control_timeout_s,
                            deadline_flag="--engine-control-timeout")

    # ------------------------------------------------------------------ joining
    def _new_record(self, actor: Any = None, placement: Any = None, own_group: Any = None,
                    refuse_when_closing: bool = False) -> Engine:
        with self.lock:  # under the lock: `shutdown` either sees this record or this sees `closing`
            if refuse_when_closing and self.closing:
                raise AddAbandoned("no engine is added: the run is shutting down")
            engine = Engine(self.next_id, actor=actor, placement=placement, own_group=own_group)
            self.engines[engine.id] = engine
            self.next_id += 1
        return engine

    def start_initial(self, placements: list[Any], launched: Optional[list[tuple[Any, Any]]] = None) -> list[str]:
        """The run's first engines, one per placement, started at once and registered as they are: every one
        serves --hf-checkpoint, which is the weights of the run's start. `launched`: (actor, ref of its
        `start`) per placement, for engines whose start was begun elsewhere (the controller begins them
        before the rollout manager is up, relax.core.controller)."""
        records = [self._new_record(placement=p) for p in placements]
        if launched is not None:
            for e, (actor, _) in zip(records, launched):
                e.actor = actor
            starts = [ref for _, ref in launched]
        else:
            for e in records:
                e.actor = self.make_actor(e.id, e.placement)
            starts = [e.actor.start.remote() for e in records]
        urls = ray.get(starts)
        for e, url in zip(records, urls):
            e.url = url
            self._register(e)
        return urls

    def adopt(self, url: str) -> None:
        """An engine Relax did not start (--rollout-external): it joins the router as it is."""
        e = self._new_record()
        e.url = url
        self._register(e)

    def add(self, count: int = 1, *, cancel: Optional[threading.Event] = None) -> list[str]:
        """`count` engines beyond the current ones, each on room reserved for it alone; each gets the current
        weights before it joins the router. Returns their URLs.

        Refused once the pool is closing (`shutdown`), like `replace`: a start still under way when the pool
        begins to close, or when `cancel` is set (the autoscaler's --scale-out-timeout ran out), is abandoned
        at the next step (start polled every ADD_POLL_S, before the router, after it): its server is stopped,
        it leaves the router if it had joined, and RuntimeError is raised. An engine that is not wanted any
        more never stays behind serving without being in the pool."""
        if self.make_actor is None:
            raise RuntimeError("this pool cannot start engines (external engines)")
        added = []
        for _ in range(count):
            self._check_wanted(None, cancel)
            placement = self.new_placement() if self.new_placement is not None else None
            own_group = placement[0] if placement is not None else None
            try:
                e = self._new_record(placement=placement, own_group=own_group, refuse_when_closing=True)
            except AddAbandoned:
                self._give_back(own_group)
                raise
            try:
                self._check_wanted(e, cancel)
                e.actor = self.make_actor(e.id, placement)
                self._check_wanted(e, cancel)
                e.url = self._await_start(e, cancel)
                self._check_wanted(e, cancel)
                self._join(e, check=lambda: self._check_wanted(e, cancel))
                self._check_wanted(e, cancel)  # closing or a cancel may have come while it joined the router
            except Exception as exc:
                self._abandon(e, exc)
                raise
            self.event("engine_added", engine=e.id, url=e.url, weight_version=e.weight_version)
            added.append(e.url)
        return added

    def _check_wanted(self, e: Optional[Engine], cancel: Optional[threading.Event]) -> None:
        what = "a new engine" if e is None else f"engine {e.id}"
        if self.closing:
            raise AddAbandoned(f"{what}: abandoned, the run is shutting down")
        if cancel is not None and cancel.is_set():
            raise AddAbandoned(f"{what}: abandoned, its addition was cancelled")

    def _await_start(self, e: Engine, cancel: Optional[threading.Event]) -> str:
        """The new engine's URL once its start returns, within start_timeout_s; polled so that a cancel or the
        pool's closing ends the wait (and the start) at once instead of after the server came up."""
        ref = e.actor.start.remote()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            left = deadline - time.monotonic()
            ready, _ = ray.wait([ref], timeout=max(0.0, min(ADD_POLL_S, left)), fetch_local=True)
            if ready:
                return ray.get(ready[0])
            self._check_wanted(e, cancel)
            if left <= 0:
                raise ray.exceptions.GetTimeoutError(
                    f"engine {e.id} did not start within {self.start_timeout_s:g} s")

    def _abandon(self, e: Engine, why: Exception) -> None:
        """An engine whose addition failed or was abandoned: off the router if it had joined, stopped, gone."""
        with self.lock:
            was, e.state = e.state, STOPPED
        if was == ACTIVE:
            self.leave_router(e)
        self._stop(e)
        self._discard(e)
        if isinstance(why, AddAbandoned):
            self.event("engine_add_abandoned", engine=e.id, url=e.url, reason=str(why))

    def _join(self, e: Engine, check: Optional[Callable[[], None]] = None) -> None:
        """Weights, then the router; `check` (raising) runs before the router, after the weight sync."""
        e.state = SYNCING
        self._sync(e)
        if check is not None:
            check()
        if self.released:  # colocation has the others' memory released: this one follows them
            self._client(e.url).release_memory(sorted(self.released))
        self._register(e)

    def _sync(self, e: Engine) -> None:
        """Give engine `e` the current weights and check that it serves the pool's version."""
        client = self._client(e.url)
        try:
            for _ in range(SYNC_ATTEMPTS):
                pushed = None
                if self.weight_source is not None:
                    pushed = ray.get(self.weight_source.push_kept_weights.remote([e.url]),
                                     timeout=self.sync_timeout_s)
                served = client.get_weight_version()
                with self.lock:
                    wanted = self.weight_version
                    if pushed is not None and _newer(str(pushed["version"]), wanted):
                        # the source keeps the last push's weights: a push that is still being sent to the
                        # other engines (the pool hears of it when it has finished) is the current version
                        wanted = self.weight_version = str(pushed["version"])
                e.weight_version = served
                if wanted is None or served == wanted:
                    self.event("engine_synced", engine=e.id, url=e.url, weight_version=served,
                               pushed=pushed is not None)
                    return
            why = ("" if self.weight_source is not None and pushed is not None else
                   " (nothing to push it: trainer rank 0 keeps the pushed weights with --use-fault-tolerance or "
                   "--autoscaler-config)")
            raise RuntimeError(f"engine {e.url} serves weight version {served!r} after {SYNC_ATTEMPTS} attempts; the "
                               f"pool's version is {wanted!r}{why}")
        finally:
            client.close()

    def _register(self, e: Engine) -> None:
        self.router.add_worker(e.url)
        with self.lock:
            e.state = ACTIVE
        self.event("engine_registered", engine=e.id, url=e.url, weight_version=e.weight_version)

    def set_weight_version(self, version: Any, urls: list[str]) -> None:
        """After a push of `version` to `urls` (each verified by the push itself)."""
        with self.lock:
            self.push_started = None
            self.weight_version = str(version)
            for e in self.engines.values():
                if e.url in urls:
                    e.weight_version = str(version)
        self.event("weights_pushed", weight_version=str(version), urls=list(urls))

    def push_targets(self) -> list[str]:
        """The engines a weight push must reach now: the active ones and those taking weights to join. An
        engine that does not answer /health is taken out first (replaced when `on_failure` is set), so a
        push never waits on one that died since the last probe."""
        with self.lock:
            candidates = [e for e in self.engines.values() if e.state in (ACTIVE, SYNCING) and e.url]
            self.push_started = time.monotonic()
        if not candidates or self.on_failure is None:  # without fault tolerance a dead engine fails the push
            return [e.url for e in candidates]
        with ThreadPoolExecutor(max_workers=len(candidates)) as pool:
            alive = list(pool.map(lambda e: self._healthy(e.url, min(5.0, self.control_timeout_s)), candidates))
        for e, ok in zip(candidates, alive):
            if not ok and self.on_failure is not None:
                self.on_failure(e, "no answer to /health before a weight push")
        return [e.url for e, ok in zip(candidates, alive) if ok]

    @property
    def pushing(self) -> bool:
        started = self.push_started
        return started is not None and time.monotonic() - started < self.sync_timeout_s

    def _healthy(self, url: str, timeout_s: float) -> bool:
        client = self._client(url, timeout_s)
        try:
            return client.health(timeout_s=timeout_s)
        finally:
            client.close()

    # ------------------------------------------------------------------ leaving
    def leave_router(self, e: Engine) -> None:
        try:
            self.router.remove_worker(e.url)
        except Exception as exc:  # already gone from the router (it may drop dead workers itself)
            logger.warning("engine pool: removing %s from the router: %s", e.url, exc)

    def remove(self, url: str, *, stop: bool = True) -> None:
        """Take an engine out now: off the router, its server stopped, its own placement group given back."""
        e = self.by_url(url)
        with self.lock:
            was = e.state
            e.state = STOPPED
        if was == ACTIVE:  # a draining engine already left the router (`drain`): asking again fails
            self.leave_router(e)
        if stop:
            self._stop(e)
        self._discard(e)
        self.event("engine_removed", engine=e.id, url=url)

    def drain(self, url: str, timeout_s: float = 30.0) -> bool:
        """Off the router (no new requests), wait until the engine has no request left or `timeout_s` passed,
        then remove it. True when it had drained."""
        e = self.by_url(url)
        with self.lock:
            e.state = DRAINING
        self.leave_router(e)
        deadline = time.monotonic() + timeout_s
        drained = False
        client = self._client(url, min(5.0, timeout_s) or 5.0)
        try:
            while time.monotonic() < deadline:
                try:
                    if client.num_requests() == 0:
                        drained = True
                        break
                except Exception:
                    break  # no answer: nothing more to wait for
                time.sleep(0.1)
        finally:
            client.close()
        self.remove(url)
        return drained

    def _stop(self, e: Engine) -> None:
        if e.actor is None:
            return
        if e.url is not None:  # a server that is up stops by itself; one still starting is killed at once
            try:  # (its actor runs one call at a time: a shutdown would wait behind the start)
                ray.get(e.actor.shutdown.remote(), timeout=self.stop_timeout_s)
            except Exception:  # the actor may already be gone
                pass
        try:
            ray.kill(e.actor)  # its resources (a bundle of the placement group) are free for another engine
        except Exception:
            pass

    def _discard(self, e: Engine) -> None:
        with self.lock:
            self.engines.pop(e.id, None)
        self._give_back(e.own_group)

    def _give_back(self, own_group: Any) -> None:
        if own_group is not None and self.remove_placement is not None:
            try:
                self.remove_placement(own_group)
            except Exception:
                pass

    # ------------------------------------------------------------------ failures
    def fail(self, e: Engine, reason: str) -> bool:
        """Engine `e` failed: off the router at once and its server killed. False when another caller had
        already taken it out (one failure is handled once)."""
        with self.lock:
            if e.state not in (ACTIVE, SYNCING):
                return False
            was, e.state = e.state, DEAD
        self.event("engine_failed", engine=e.id, url=e.url, reason=reason)
        if was == ACTIVE:
            self.leave_router(e)
        if e.actor is not None:
            try:
                ray.get(e.actor.kill_server.remote(), timeout=self.control_timeout_s)
            except Exception as exc:  # the actor itself is gone: the replacement makes a new one
                logger.warning("engine pool: killing the server of engine %d: %s", e.id, exc)
        return True

    def replace(self, e: Engine) -> str:
        """Start engine `e` again on its own devices (its actor, or a new actor on its placement when the actor
        is gone), give it the current weights and register it. Returns the new URL."""
        if e.actor is None:
            raise RuntimeError(f"engine {e.url} was not started by Relax (--rollout-external): it cannot be restarted")
        old = e.url
        last: Exception | None = None
        for attempt in range(1, REPLACE_ATTEMPTS + 1):
            with self.lock:
                e.state = STARTING
            try:
                if self.closing:
                    raise RuntimeError("the run is shutting down")
                try:
                    url = ray.get(e.actor.restart.remote(), timeout=self.start_timeout_s)
                except ray.exceptions.RayActorError:
                    e.actor = self.make_actor(e.id, e.placement)
                    url = ray.get(e.actor.start.remote(), timeout=self.start_timeout_s)
                if self.closing:  # a server that came up during the shutdown must not outlive the run
                    ray.get(e.actor.kill_server.remote(), timeout=self.control_timeout_s)
                    raise RuntimeError("the run is shutting down")
                e.url = url
                e.started_at = time.time()
                self._join(e)
                self.event("engine_replaced", engine=e.id, old_url=old, url=url, weight_version=e.weight_version,
                           attempt=attempt)
                return url
            except Exception as exc:
                last = exc
                logger.warning("engine pool: replacing engine %d (attempt %d): %s", e.id, attempt, exc)
                with self.lock:
                    e.state = DEAD
                if self.closing:
                    break
        raise RuntimeError(f"engine {old} could not be replaced ({attempt} attempt(s)): {last}")

    # ------------------------------------------------------------------ colocation
    def release_memory(self, tags: list[str]) -> None:
        for url in self.urls():
            self._client(url).release_memory(tags)
        with self.lock:
            self.released |= set(tags)

    def resume_memory(self, tags: list[str]) -> None:
        tags = [t for t in tags if t in self.released]
        if not tags:
            return
        for url in self.urls():
            self._client(url).resume_memory(tags)
        with self.lock:
            self.released -= set(tags)

    # ------------------------------------------------------------------ the end
    def shutdown(self) -> None:
        self.closing = True  # an `add` or `replace` under way stops the engine it is starting
        with self.lock:
            engines = list(self.engines.values())
        for e in engines:
            self._stop(e)
            self._discard(e)


class HealthMonitor:
    """--use-fault-tolerance: probes every active engine's /health_generate and replaces the ones that fail, and
    starts the router again (its engines re-registered) when its process has exited."""

    def __init__(self, pool: EnginePool, *, interval_s: float, timeout_s: float, first_wait_s: float = 0.0):
        self.pool = pool
        self.interval_s = max(0.05, float(interval_s))
        self.timeout_s = float(timeout_s)
        self.first_wait_s = float(first_wait_s)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._replacing: set[int] = set()
        self._threads: list[threading.Thread] = []
        self._router_silent = 0  # rounds in a row the router has not answered /health
        self.errors: list[str] = []  # replacements that failed for good
        pool.on_failure = self.handle

    def start(self) -> "HealthMonitor":
        self._thread = threading.Thread(target=self._run, args=(self.probe_once, "engine health probe round"),
                                        name="relax-engine-health", daemon=True)
        self._thread.start()
        # the router is checked in a thread of its own: its /health probe (up to one probe timeout) never delays
        # finding a failed engine
        router_thread = threading.Thread(target=self._run, args=(self.check_router, "router health check"),
                                         name="relax-router-health", daemon=True)
        self._threads.append(router_thread)
        router_thread.start()
        return self

    def stop(self, wait_s: float = 10.0) -> None:
        """Stop probing; give a replacement under way up to `wait_s` to end (the pool is closing, so it stops
        the server it may just have started), so that no server starts after the engines were stopped."""
        self._stop.set()
        self.pool.closing = True
        deadline = time.monotonic() + wait_s
        for thread in [self._thread, *self._threads]:
            if thread is not None:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _run(self, round_fn: Callable[[], Any], what: str) -> None:
        """`round_fn()` every interval (after the first wait) until stopped."""
        if self._stop.wait(self.first_wait_s):
            return
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                round_fn()
            except Exception as exc:  # a round must never end the monitor
                logger.warning("%s failed: %r", what, exc)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def check_router(self) -> bool:
        """A router whose process exited (or that stopped answering) is started again at its address, and every
        active engine joins it again (requests sent meanwhile are re-sent by the rollout within the failover
        window, relax.rollout.generate). True when it restarted the router."""
        router = self.pool.router
        alive = getattr(router, "is_alive", None)
        if alive is None or self.pool.closing or self._stop.is_set():
            return False
        if alive():
            # a hung router (stopped, deadlocked) is alive but silent: two rounds without an answer to /health,
            # so that one slow answer on a busy host does not cost the requests it holds
            self._router_silent = 0 if self._answers(router.url) else self._router_silent + 1
            if self._router_silent < 2:
                return False
            why = f"no answer to /health within {self.timeout_s:g} s twice (--rollout-health-check-timeout)"
            router.stop(timeout_s=2.0)
        else:
            why = f"its process exited (code {router.returncode() if hasattr(router, 'returncode') else None})"
        self._router_silent = 0
        try:
            router.start()
            with self.pool.lock:
                urls = [e.url for e in self.pool.engines.values() if e.state == ACTIVE and e.url]
            for url in urls:
                router.add_worker(url)
        except Exception as exc:
            self.errors.append(f"router restart: {exc}")
            self.pool.event("router_restart_failed", url=router.url, reason=f"{why}; restart: {exc}")
            logger.error("the router at %s failed (%s) and could not be started again: %s", router.url, why, exc)
            return False
        logger.warning("the router at %s failed (%s); started again with %d engine(s)", router.url, why, len(urls))
        self.pool.event("router_restarted", url=router.url, reason=why, engines=len(urls))
        return True

    def _answers(self, url: str) -> bool:
        try:
            return requests.get(url + "/health", timeout=self.timeout_s).status_code < 500
        except requests.RequestException:
            return False

    def probe_once(self) -> list[str]:
        """One round: every active engine at once. Returns the URLs that failed."""
        if self.pool.released or self.pool.pushing:  # released memory answers 503; a push may delay answers
            return []
        with self.pool.lock:
            engines = [e for e in self.pool.engines.values() if e.state == ACTIVE and e.url]
        if not engines:
            return []

        with ThreadPoolExecutor(max_workers=len(engines)) as executor:
            answers = list(executor.map(lambda e: probe_engine(e.url, self.timeout_s), engines))
        failed = []
        for e, ok in zip(engines, answers):
            if not ok and not self.pool.released and not self.pool.pushing:
                failed.append(e.url)
                self.handle(e, f"/health_generate failed or gave no answer within {self.timeout_s:g} s "
                               "(--rollout-health-check-timeout)")
        return failed

    def handle(self, e: Engine, reason: str) -> None:
        """Take the engine out now; replace it in the background (probing goes on meanwhile)."""
        if not self.pool.fail(e, reason):
            return
        if e.id in self._replacing:
            return
        self._replacing.add(e.id)
        thread = threading.Thread(target=self._replace, args=(e,), name=f"relax-replace-engine-{e.id}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _replace(self, e: Engine) -> None:
        try:
            self.pool.replace(e)
        except Exception as exc:
            self.errors.append(str(exc))
            self.pool.event("engine_replace_failed", engine=e.id, reason=str(exc))
        finally:
            self._replacing.discard(e.id)


def stop_engines(monitor: Optional["HealthMonitor"], router: Any, pool: Optional[EnginePool], wait_s: float) -> None:
    """Stop one set of engines in the order that loses nothing: the health monitor first (no replacement starts
    while they stop; it waits at most `wait_s` for one under way), then the router, then the pool's engines.
    Any of them may be None."""
    if monitor is not None:
        monitor.stop(wait_s=wait_s)
    if router is not None:
        router.stop()
    if pool is not None:
        pool.shutdown()
