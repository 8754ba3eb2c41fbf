"""The liveness watch's bookkeeping (--engine-liveness-timeout): which engine has answered nothing for too long
while requests are in flight. No threads, no HTTP, no Ray: `relax.rollout.engine_watch` drives it with real
probes and the clock; tests drive it with a fake clock.

Why a watch of its own: a request's deadline (--generate-timeout, 600 s by default) has to allow the longest
generation, so an engine that stopped answering (SIGSTOPped, deadlocked, its host frozen) would stall a step for
that long with the progress bar standing still. An engine that is alive answers a cheap probe (/health_generate)
within seconds even while it generates, so silence on the probe for a bounded time (60 s by default) is a fault
whatever the length of the generations.

Silence counts only while requests are in flight (`begin` .. `end`, a rollout step or an evaluation): between
steps an engine may be paused, taking weights or have its memory released, and nobody waits on it. It counts
from the latest of: the engine's last answer, the start of the span, the first time the watch saw the engine
(one that joined mid-step), and the end of the last `hold` (a weight push or released memory, when an engine may
answer late by design). Each engine (URL) is reported once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable


class EngineUnresponsive(RuntimeError):
    """An engine with requests in flight answered nothing for --engine-liveness-timeout seconds (the run stops;
    the message, one line, names the engine, its address and the step)."""


@dataclass(frozen=True)
class Silence:
    """One engine found silent: its URL, for how long, and what was in flight (e.g. `rollout step 3`)."""

    url: str
    silent_s: float
    during: str


class LivenessWatch:
    """Thread-safe. `timeout_s` > 0: the silence that makes an engine unresponsive; `interval_s`: how often each
    engine is probed (a probe still out is never doubled: a hung engine holds one probe until it times out)."""

    def __init__(self, timeout_s: float, interval_s: float, clock: Callable[[], float] = time.monotonic):
        if not timeout_s > 0:
            raise ValueError(f"the liveness timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.interval_s = float(interval_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._spans: list[str] = []  # what is in flight, oldest first (a step and an evaluation may overlap)
        self._since = 0.0  # silence counts from here at the earliest (start of the spans, end of a hold)
        self._answered: dict[str, float] = {}  # url -> time of its last answer (or of its first sighting)
        self._probe_sent: dict[str, float] = {}  # url -> when its last probe went out
        self._out: set[str] = set()  # urls with a probe out
        self._named: set[str] = set()  # urls already reported

    # ------------------------------------------------------------------ spans
    @property
    def in_flight(self) -> bool:
        with self._lock:
            return bool(self._spans)

    def begin(self, during: str) -> None:
        """Requests go out (`during`: what, e.g. `rollout step 3`); the first span starts every engine's count."""
        with self._lock:
            if not self._spans:
                self._since = self.clock()
            self._spans.append(during)

    def end(self, during: str) -> None:
        with self._lock:
            if during in self._spans:
                self._spans.remove(during)

    def hold(self) -> None:
        """Engines may answer late by design now (a weight push, released memory): their count starts again."""
        with self._lock:
            self._since = self.clock()

    # ------------------------------------------------------------------ probes
    def to_probe(self, urls: list[str]) -> list[str]:
        """Of `urls` (the active engines), those to probe now, marked as having a probe out."""
        now = self.clock()
        due = []
        with self._lock:
            for url in urls:
                if url in self._out or now - self._probe_sent.get(url, -float("inf")) < self.interval_s:
                    continue
                self._out.add(url)
                self._probe_sent[url] = now
                due.append(url)
        return due

    def probed(self, url: str, answered: bool) -> None:
        """A probe of `url` came back: answered (200) or not (an error, a non-200, its own timeout)."""
        with self._lock:
            self._out.discard(url)
            if answered:
                self._answered[url] = self.clock()

    # ------------------------------------------------------------------ verdict
    def silent(self, urls: list[str]) -> list[Silence]:
        """Of `urls` (the active engines), those silent for the timeout with requests in flight, each once."""
        now = self.clock()
        found = []
        with self._lock:
            if not self._spans:
                return []
            during = self._spans[-1]
            for url in urls:
                last = max(self._answered.setdefault(url, now), self._since)
                if url not in self._named and now - last >= self.timeout_s:
                    self._named.add(url)
                    found.append(Silence(url, now - last, during))
        return found

    def forget(self, keep: set[str]) -> None:
        """Drop what is known of engines no longer in the pool (all but `keep`): a later engine on the same
        address (a replacement may get the port back) is watched afresh."""
        with self._lock:
            for url in [u for u in self._answered if u not in keep]:
                del self._answered[url]
            self._probe_sent = {u: t for u, t in self._probe_sent.items() if u in keep}
            self._named &= keep
