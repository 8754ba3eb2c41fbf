"""The autoscaler (--autoscaler-config): adds rollout engines under load and removes them when load falls.

A thread of the rollout manager. Every `metrics_interval_secs` it reads each active engine's `/metrics` (SGLang's
Prometheus names; the embedded engine exports the same, relax.backends.embedded.metrics_text) into a window of
`condition_window_secs`; every `evaluation_interval_secs` it decides (`decide`, pure, tested alone):

- scale out when any scale-out condition held over the last `condition_duration_secs` (mean token usage, queued
  requests per engine, and the p95 queue time / time to first token when the engines export those histograms),
  by what the load asks for (queue / queue_depth_per_engine), at most `max_delta`, up to `max_engines`, not within
  `scale_out_cooldown_secs` of the last scale-out;
- scale in when every scale-in condition held over its duration (low usage, short queues, steady throughput) and
  the remaining engines would carry at most `projected_usage_max`, by at most `max_delta`, down to `min_engines`,
  not within `scale_in_cooldown_secs` of any scaling.

Scale-out goes through the engine pool (relax.rollout.engine_pool: start, health, weight sync to the current
version, router), bounded by --scale-out-timeout; with --scale-out-partial-success-policy rollback_all a partly
failed scale-out removes the engines it added. Scale-in removes the newest engines first: off the router, in-flight
requests drained within --scale-in-drain-timeout, then stopped (the pool's stop waits --scale-in-shutdown-timeout before it kills). Every
decision, with its reason and the metrics behind it, goes to `decisions` (the rollout manager's
`autoscaler_status`) and to OUTPUT_DIR/autoscaler.jsonl.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from relax.backends.auth import engine_api_key
from relax.config.autoscaler import AutoscalerConfig
from relax.observability.metrics_client import scrape_engine_metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSample:
    """The engines' load at one time: means over the active engines, totals where said."""

    time: float
    engines: int
    token_usage: float
    queue_per_engine: float
    throughput: float  # generated tokens/s, all engines
    queue_time_p95: Optional[float] = None
    ttft_p95: Optional[float] = None


def sample_from_metrics(now: float, per_engine: list[dict[str, float]]) -> LoadSample:
    """One `LoadSample` from each engine's scraped metrics ({"name{labels}": value})."""

    def values(name: str) -> list[float]:
        return [sum(v for k, v in m.items() if k.split("{")[0] == name) for m in per_engine]

    n = max(1, len(per_engine))
    usage = values("sglang:token_usage")
    queue = values("sglang:num_queue_reqs")
    return LoadSample(time=now, engines=len(per_engine), token_usage=sum(usage) / n,
                      queue_per_engine=sum(queue) / n, throughput=sum(values("sglang:gen_throughput")))


@dataclass(frozen=True)
class Decision:
    action: str  # "scale_out", "scale_in" or "hold"
    delta: int
    reason: str


def _held(samples: list[LoadSample], now: float, duration: float, test) -> bool:
    """Whether `test` held for every sample of the last `duration` seconds, and the samples span that long."""
    recent = [s for s in samples if s.time >= now - duration]
    return bool(recent) and recent[0].time <= now - duration + _slack(samples) and all(test(s) for s in recent)


def _slack(samples: list[LoadSample]) -> float:
    """A sampling interval's worth of tolerance at the window's start."""
    if len(samples) < 2:
        return 0.0
    return max(b.time - a.time for a, b in zip(samples, samples[1:]))


def decide(cfg: AutoscalerConfig, samples: list[LoadSample], engines: int, now: float,
           last_scale_out: float, last_scale: float) -> Decision:
    """The decision for `engines` active engines from the window `samples` (oldest first)."""
    out, inn = cfg.scale_out_policy, cfg.scale_in_policy
    if not samples:
        return Decision("hold", 0, "no metrics yet")
    last = samples[-1]
    if engines < cfg.min_engines:
        return Decision("scale_out", cfg.min_engines - engines, f"{engines} engines, below min_engines")
    conditions = {
        f"token usage above {out.token_usage_threshold}": lambda s: s.token_usage > out.token_usage_threshold,
        f"queue per engine above {out.queue_depth_per_engine}": lambda s: s.queue_per_engine > out.queue_depth_per_engine,
        f"queue time p95 above {out.queue_time_p95_threshold} s":
            lambda s: s.queue_time_p95 is not None and s.queue_time_p95 > out.queue_time_p95_threshold,
        f"time to first token p95 above {out.ttft_p95_threshold} s":
            lambda s: s.ttft_p95 is not None and s.ttft_p95 > out.ttft_p95_threshold,
    }
    held = [name for name, test in conditions.items() if _held(samples, now, out.condition_duration_secs, test)]
    if held:
        if engines >= cfg.max_engines:
            return Decision("hold", 0, f"{held[0]}, but already at max_engines {cfg.max_engines}")
        if now - last_scale_out < cfg.scale_out_cooldown_secs:
            return Decision("hold", 0, f"{held[0]}, but within scale_out_cooldown_secs")
        wanted = 1
        if out.queue_depth_per_engine > 0:  # engines the queue asks for beyond the current ones
            wanted = max(1, math.ceil(last.queue_per_engine * engines / out.queue_depth_per_engine) - engines)
        delta = min(out.max_delta, cfg.max_engines - engines, wanted)
        return Decision("scale_out", delta, f"{' and '.join(held)} for {out.condition_duration_secs:g} s "
                                            f"(usage {last.token_usage:.3f}, queue/engine {last.queue_per_engine:.1f})")
    if engines <= cfg.min_engines:
        return Decision("hold", 0, "at min_engines")
    if now - last_scale < cfg.scale_in_cooldown_secs:
        return Decision("hold", 0, "within scale_in_cooldown_secs")
    recent = [s for s in samples if s.time >= now - inn.condition_duration_secs]
    throughputs = [s.throughput for s in recent]
    mean_tp = statistics.fmean(throughputs) if throughputs else 0.0
    variation = statistics.pstdev(throughputs) / mean_tp if mean_tp > 0 and len(throughputs) > 1 else 0.0
    low = (_held(samples, now, inn.condition_duration_secs,
                 lambda s: s.token_usage < inn.token_usage_threshold
                 and s.queue_per_engine <= inn.queue_depth_threshold)
           and variation < inn.throughput_variance_threshold)
    if not low:
        return Decision("hold", 0, "load within bounds")
    delta = 0
    for k in range(1, min(inn.max_delta, engines - cfg.min_engines) + 1):
        if last.token_usage * engines / (engines - k) <= inn.projected_usage_max:
            delta = k
    if delta == 0:
        return Decision("hold", 0, "low load, but fewer engines would carry more than projected_usage_max")
    return Decision("scale_in", delta, f"token usage below {inn.token_usage_threshold}, queue/engine at most "
                                       f"{inn.queue_depth_threshold}, throughput variation {variation:.2f} for "
                                       f"{inn.condition_duration_secs:g} s")


class Autoscaler:
    def __init__(self, cfg: AutoscalerConfig, pool: Any, *, scale_out_timeout_s: float, partial_policy: str,
                 drain_timeout_s: float, log_path: Optional[str] = None):
        self.cfg = cfg
        self.pool = pool
        self.scale_out_timeout_s = scale_out_timeout_s
        self.partial_policy = partial_policy
        self.drain_timeout_s = drain_timeout_s
        self.log_path = Path(log_path) if log_path else None
        self.samples: list[LoadSample] = []
        self.decisions: list[dict[str, Any]] = []
        self.last_scale_out = self.last_scale = float("-inf")
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Autoscaler":
        self._thread = threading.Thread(target=self._run, name="relax-autoscaler", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    def status(self) -> dict[str, Any]:
        return {"engines": self.pool.list(), "last_sample": self.samples[-1].__dict__ if self.samples else None,
                "decisions": list(self.decisions), "config": self.cfg.as_dict()}

    def _run(self) -> None:
        next_eval = time.monotonic() + self.cfg.evaluation_interval_secs
        while not self._stop.wait(self.cfg.metrics_interval_secs):
            try:
                self.observe()
                if time.monotonic() >= next_eval:
                    next_eval = time.monotonic() + self.cfg.evaluation_interval_secs
                    self.step()
            except Exception as exc:  # a failed scrape or scaling is logged; the run goes on with its engines
                logger.warning("autoscaler: %s", exc)
                self._record("error", 0, str(exc))

    def observe(self) -> LoadSample:
        urls = self.pool.urls()
        per_engine = []
        for url in urls:
            try:
                per_engine.append(scrape_engine_metrics(url, engine_api_key(), timeout_s=5.0))
            except Exception as exc:
                logger.debug("autoscaler: no metrics from %s: %s", url, exc)
        now = time.monotonic()
        sample = sample_from_metrics(now, per_engine)
        keep = max(self.cfg.condition_window_secs, self.cfg.scale_out_policy.condition_duration_secs,
                   self.cfg.scale_in_policy.condition_duration_secs) + self.cfg.metrics_interval_secs
        self.samples = [s for s in self.samples if s.time >= now - keep] + [sample]
        return sample

    def step(self) -> Decision:
        now = time.monotonic()
        engines = len(self.pool.urls())
        decision = decide(self.cfg, self.samples, engines, now, self.last_scale_out, self.last_scale)
        if decision.action == "scale_out":
            self._scale_out(decision)
        elif decision.action == "scale_in":
            self._scale_in(decision)
        else:
            self._record("hold", 0, decision.reason)
        return decision

    def _scale_out(self, decision: Decision) -> None:
        added: list[str] = []
        with ThreadPoolExecutor(max_workers=decision.delta) as pool:
            futures = [pool.submit(self.pool.add, 1) for _ in range(decision.delta)]
            deadline = time.monotonic() + self.scale_out_timeout_s
            failed = 0
            for fut in futures:
                try:
                    added += fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except (FutureTimeout, Exception) as exc:
                    failed += 1
                    logger.warning("autoscaler: an engine of the scale-out did not come up: %s", exc)
        if failed and self.partial_policy == "rollback_all":
            for url in added:
                self.pool.remove(url)
            self._record("scale_out_rolled_back", -len(added), f"{failed} of {decision.delta} engines failed "
                                                               f"(--scale-out-partial-success-policy rollback_all)")
            return
        now = time.monotonic()
        self.last_scale_out = self.last_scale = now
        self.samples = []  # the old window described fewer engines
        self._record("scale_out", len(added), decision.reason, urls=added)

    def _scale_in(self, decision: Decision) -> None:
        newest = sorted(self.pool.list(), key=lambda e: e["id"], reverse=True)
        victims = [e["url"] for e in newest if e.get("state") == "active"][:decision.delta]
        drained = [self.pool.drain(url, self.drain_timeout_s) for url in victims]
        self.last_scale = time.monotonic()
        self.samples = []
        self._record("scale_in", -len(victims), decision.reason, urls=victims, drained=drained)

    def _record(self, action: str, delta: int, reason: str, **extra: Any) -> None:
        row = {"time": time.time(), "action": action, "delta": delta, "engines": len(self.pool.urls()),
               "reason": reason, **extra}
        self.decisions.append(row)
        if action != "hold":
            logger.warning("autoscaler: %s %+d -> %d engines: %s", action, delta, row["engines"], reason)
        if self.log_path is not None:
            with self.log_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
