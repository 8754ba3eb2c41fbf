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

The throughput is each engine's `sglang:generation_tokens_total` (a cumulative counter) over the time between
this autoscaler's own two last scrapes of it (`ThroughputMeter`; an engine seen for the first time or whose counter
went down, i.e. restarted, gives no rate for that sample), so other readers of /metrics (the metrics service) do
not change it; an engine without that counter is read by its `sglang:gen_throughput` gauge.

Scale-out goes through the engine pool (relax.rollout.engine_pool: start, health, weight sync to the current
version, router) and returns by --scale-out-timeout: an engine not in by then is cancelled (the pool stops its
start), and one that still comes up later is removed as it does, so no engine serves unaccounted. With
--scale-out-partial-success-policy rollback_all a scale-out with any engine failed or late removes all it added
(and gives up on the others at the first failure); keep_partial keeps those that came up in time. Scale-in removes
the newest engines first: off the router, in-flight requests drained within --scale-in-drain-timeout, then stopped
(the pool's stop waits --scale-in-shutdown-timeout before it kills).

Every decision, with its reason and the metrics behind it, goes to OUTPUT_DIR/autoscaler.jsonl and to `decisions`
(the last `KEPT_DECISIONS` of them; the rollout manager's `autoscaler_status`), one row each: `time` is when it was decided (wall clock);
a scaling's row is written once it has finished, with `done_time` and `duration_s` (and `engines`, the active
engines then). While a scaling is under way, `status()["scaling"]` shows it.

`status()` (the engines with their last scraped metrics, the config, the scaling under way and the decisions) is
also written atomically to OUTPUT_DIR/autoscaler_status.json after each observation, at a scaling's start and
after each decision (relax/observability/autoscaler_status.py; `relax-status RUN_DIR` shows it), and handed to
`publish` (the rollout manager's: the metrics service's `/autoscaler`).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from collections import deque
from concurrent.futures import ALL_COMPLETED, FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from relax.wire.auth import engine_api_key
from relax.config.autoscaler import AutoscalerConfig
from relax.observability.autoscaler_status import STATUS_FILE, write_status
from relax.observability.metrics_client import scrape_engine_metrics, split_metric_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSample:
    """The engines' load at one time: means over the active engines, totals where said."""

    time: float
    engines: int
    token_usage: float
    queue_per_engine: float
    throughput: Optional[float]  # generated tokens/s, all engines; None: not every engine had a rate yet
    queue_time_p95: Optional[float] = None
    ttft_p95: Optional[float] = None


def _metric(metrics: dict[str, float], name: str) -> Optional[float]:
    """The sum of `name`'s series in one engine's scrape; None when the engine does not export it."""
    values = [v for k, v in metrics.items() if k.split("{")[0] == name]
    return sum(values) if values else None


class ThroughputMeter:
    """Generated tokens/s per engine from the cumulative `sglang:generation_tokens_total`: the difference between
    this meter's last two readings of an engine over their time apart. Counters are cumulative, so other readers
    of /metrics do not affect the rate. No rate from an engine's first reading, nor when its counter went down
    (the engine restarted); an engine without the counter is read by its `sglang:gen_throughput` gauge."""

    def __init__(self):
        self._last: dict[str, tuple[float, float]] = {}  # url -> (time of the reading, counter)

    def rates(self, readings: dict[str, tuple[float, dict[str, float]]]) -> dict[str, Optional[float]]:
        """`readings`: url -> (monotonic time of the scrape, its metrics). Engines not read this time are
        forgotten (removed or unreachable: a later reading starts afresh)."""
        rates: dict[str, Optional[float]] = {}
        last, self._last = self._last, {}
        for url, (when, metrics) in readings.items():
            total = _metric(metrics, "sglang:generation_tokens_total")
            if total is None:
                rates[url] = _metric(metrics, "sglang:gen_throughput")
                continue
            self._last[url] = (when, total)
            before = last.get(url)
            if before is None or total < before[1] or when <= before[0]:
                rates[url] = None
            else:
                rates[url] = (total - before[1]) / (when - before[0])
        return rates


# gauges of an engine's /metrics shown per engine in the status (summed over their label sets)
KEPT_DECISIONS = 500  # decisions the status keeps (the newest); autoscaler.jsonl has every one
STATUS_GAUGES = ("sglang:token_usage", "sglang:num_running_reqs", "sglang:num_queue_reqs")
# histograms whose p95 over the last scrape interval is shown per engine (SGLang exports these)
STATUS_HISTOGRAMS = ("sglang:queue_time_seconds", "sglang:time_to_first_token_seconds")


def _buckets(metrics: dict[str, float], name: str) -> dict[float, float]:
    """The cumulative bucket counts of histogram `name` by upper bound (summed over other labels)."""
    out: dict[float, float] = {}
    for key, value in metrics.items():
        base, labels = split_metric_key(key)
        if base == name + "_bucket" and "le" in labels:
            try:
                le = float(labels["le"])
            except ValueError:
                continue
            out[le] = out.get(le, 0.0) + value
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> Optional[float]:
    """The `q` quantile of cumulative `buckets` (upper bound -> count) as Prometheus' histogram_quantile
    computes it (linear within a bucket; the highest finite bound when it falls in +Inf); None: no observations."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    rank = q * items[-1][1]
    lower, below = 0.0, 0.0
    for le, count in items:
        if count >= rank:
            if math.isinf(le):
                return lower
            return le if count <= below else lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def histogram_intervals(metrics: dict[str, float], before: Optional[dict[str, float]]
                        ) -> dict[str, Optional[dict[float, float]]]:
    """For each of STATUS_HISTOGRAMS the engine exports: its cumulative bucket counts of the observations between
    the scrape `before` and `metrics`; None when there is no earlier scrape or its counts went down (the engine
    restarted)."""
    out: dict[str, Optional[dict[float, float]]] = {}
    for name in STATUS_HISTOGRAMS:
        now = _buckets(metrics, name)
        if not now:
            continue
        then = _buckets(before or {}, name)
        delta = {le: count - then.get(le, 0.0) for le, count in now.items()}
        out[name] = None if not then or any(d < 0 for d in delta.values()) else delta
    return out


def engine_status_metrics(metrics: dict[str, float], intervals: dict[str, Optional[dict[float, float]]],
                          rate: Optional[float]) -> dict[str, Optional[float]]:
    """One engine's metrics for the status: the gauges it exports, its generated tokens/s (`rate`, from the
    ThroughputMeter) and the p95 of each histogram over its `intervals` (`histogram_intervals`; None when there is
    no earlier scrape, or no request finished in between)."""
    out: dict[str, Optional[float]] = {}
    for name in STATUS_GAUGES:
        value = _metric(metrics, name)
        if value is not None:
            out[name] = value if math.isfinite(value) else None
    out["sglang:gen_throughput"] = rate
    for name, delta in intervals.items():
        out[name + ":p95"] = None if delta is None else histogram_quantile(0.95, delta)
    return out


def pool_p95(name: str, intervals: list[dict[str, Optional[dict[float, float]]]]) -> Optional[float]:
    """The p95 of histogram `name` over every request the engines finished between their last two scrapes (each
    engine's `histogram_intervals`): their interval buckets summed, as Prometheus' histogram_quantile over a sum.
    None when no engine gives an interval of it (the p95 conditions then do not hold)."""
    merged: dict[float, float] = {}
    for engine in intervals:
        for le, count in (engine.get(name) or {}).items():
            merged[le] = merged.get(le, 0.0) + count
    return histogram_quantile(0.95, merged) if merged else None


def sample_from_metrics(now: float, per_engine: list[dict[str, float]],
                        rates: Optional[list[Optional[float]]] = None,
                        intervals: Optional[list[dict[str, Optional[dict[float, float]]]]] = None) -> LoadSample:
    """One `LoadSample` from each engine's scraped metrics ({"name{labels}": value}) and, in the same order, its
    generated tokens/s (`ThroughputMeter`; default: the engines' `sglang:gen_throughput` gauges) and its histogram
    intervals since its scrape before (`histogram_intervals`: the queue-time and time-to-first-token p95)."""

    def values(name: str) -> list[float]:
        return [_metric(m, name) or 0.0 for m in per_engine]

    n = max(1, len(per_engine))
    usage = values("sglang:token_usage")
    queue = values("sglang:num_queue_reqs")
    if rates is None:
        rates = values("sglang:gen_throughput")
    throughput = None if any(r is None for r in rates) else float(sum(rates))
    intervals = intervals or []
    return LoadSample(time=now, engines=len(per_engine), token_usage=sum(usage) / n,
                      queue_per_engine=sum(queue) / n, throughput=throughput,
                      queue_time_p95=pool_p95("sglang:queue_time_seconds", intervals),
                      ttft_p95=pool_p95("sglang:time_to_first_token_seconds", intervals))


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
    throughputs = [s.throughput for s in recent if s.throughput is not None]
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


def _in_thread(fn, *args: Any, **kwargs: Any) -> Future:
    """`fn` in a daemon thread of its own, as a Future: a start that outlives its deadline is left to finish (and
    be cleaned up) alone; an executor's threads would be waited for at its close and at interpreter exit."""
    future: Future = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

    threading.Thread(target=run, name="relax-autoscaler-add", daemon=True).start()
    return future


class Autoscaler:
    def __init__(self, cfg: AutoscalerConfig, pool: Any, *, scale_out_timeout_s: float, partial_policy: str,
                 drain_timeout_s: float, log_path: Optional[str] = None, status_path: Optional[str] = None,
                 publish: Optional[Callable[[dict[str, Any]], None]] = None):
        """`log_path`: the decisions' JSON lines; `status_path`: where `status()` is kept (default: beside
        `log_path`, autoscaler_status.json); `publish(status)`: called with each status written."""
        self.cfg = cfg
        self.pool = pool
        self.scale_out_timeout_s = scale_out_timeout_s
        self.partial_policy = partial_policy
        self.drain_timeout_s = drain_timeout_s
        self.log_path = Path(log_path) if log_path else None
        if status_path is None and self.log_path is not None:
            status_path = str(self.log_path.with_name(STATUS_FILE))
        self.status_path = Path(status_path) if status_path else None
        self.publish = publish
        # url -> {"metrics", "scraped_at", "scrape_error"}: the last reading of each active engine's /metrics
        self.engine_metrics: dict[str, dict[str, Any]] = {}
        self._last_readings: dict[str, dict[str, float]] = {}
        self.stopped = False
        self._status_lock = threading.Lock()
        self._status_warned = False
        self.samples: list[LoadSample] = []
        # the last KEPT_DECISIONS (a "hold" row every evaluation: a day-long run would rewrite a status file of
        # every one at each observation); autoscaler.jsonl keeps all of them
        self.decisions: deque[dict[str, Any]] = deque(maxlen=KEPT_DECISIONS)
        self.decisions_total = 0
        self.scaling: Optional[dict[str, Any]] = None  # the scaling under way: its action, delta, time, reason
        self.meter = ThroughputMeter()
        self.last_scale_out = self.last_scale = float("-inf")
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._record_lock = threading.Lock()  # rows also come from a late engine's cleanup thread

    def start(self) -> "Autoscaler":
        self._thread = threading.Thread(target=self._run, name="relax-autoscaler", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait_s: float = 30.0) -> None:
        self._stop.set()  # a scale-out under way stops waiting and cancels its starts
        if self._thread is not None:
            self._thread.join(wait_s)
        self.stopped = True
        self._write_status()

    def status(self) -> dict[str, Any]:
        """What OUTPUT_DIR/autoscaler_status.json holds (relax/observability/autoscaler_status.py): the time, the
        config, the engines with their last scraped metrics, the last load sample, the scaling under way and every
        decision."""
        now, mono = time.time(), time.monotonic()
        readings = self.engine_metrics
        engines = []
        for info in self.pool.list():
            reading = readings.get(info.get("url") or "", {})
            engines.append({**info, "metrics": reading.get("metrics"), "scraped_at": reading.get("scraped_at"),
                            "scrape_error": reading.get("scrape_error")})
        last = None
        if self.samples:
            last = dict(self.samples[-1].__dict__)
            last["time"] = now - (mono - last["time"])  # monotonic -> Unix time
        with self._record_lock:
            decisions, total = list(self.decisions), self.decisions_total
        # NaN stays a float here: the file's writer and the metrics service's answer write it as null
        return {"time": now, "state": "stopped" if self.stopped else "running", "config": self.cfg.as_dict(),
                "active_engines": sum(1 for e in engines if e.get("state") == "active"), "engines": engines,
                "last_sample": last, "scaling": self.scaling, "decisions": decisions,
                "decisions_total": total}

    def _write_status(self) -> None:
        """`status()` to the status file (atomically) and to `publish`; a failure is logged once, never raised."""
        if self.status_path is None and self.publish is None:
            return
        try:
            with self._status_lock:  # one writer at a time, so an older status never replaces a newer one
                status = self.status()
                if self.status_path is not None:
                    write_status(self.status_path, status)
                if self.publish is not None:
                    self.publish(status)
        except Exception as exc:
            if not self._status_warned:
                self._status_warned = True
                logger.warning("autoscaler: status not written to %s: %s", self.status_path, exc)

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
        readings: dict[str, tuple[float, dict[str, float]]] = {}
        errors: dict[str, str] = {}
        for url in urls:
            try:
                metrics = scrape_engine_metrics(url, engine_api_key(), timeout_s=5.0)
                readings[url] = (time.monotonic(), metrics)
            except Exception as exc:
                logger.debug("autoscaler: no metrics from %s: %s", url, exc)
                errors[url] = str(exc) or type(exc).__name__
        rates = self.meter.rates(readings)
        wall = time.time()
        shown = {url: {**self.engine_metrics.get(url, {}), "scrape_error": error} for url, error in errors.items()}
        intervals = {url: histogram_intervals(metrics, self._last_readings.get(url))
                     for url, (_, metrics) in readings.items()}
        for url, (_, metrics) in readings.items():
            shown[url] = {"metrics": engine_status_metrics(metrics, intervals[url], rates[url]),
                          "scraped_at": wall, "scrape_error": None}
        self.engine_metrics = shown
        now = time.monotonic()
        sample = sample_from_metrics(now, [m for _, m in readings.values()], [rates[url] for url in readings],
                                     list(intervals.values()))
        self._last_readings = {url: metrics for url, (_, metrics) in readings.items()}
        keep = max(self.cfg.condition_window_secs, self.cfg.scale_out_policy.condition_duration_secs,
                   self.cfg.scale_in_policy.condition_duration_secs) + self.cfg.metrics_interval_secs
        self.samples = [s for s in self.samples if s.time >= now - keep] + [sample]
        self._write_status()
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
        decided = time.time()
        self.scaling = {"action": "scale_out", "delta": decision.delta, "time": decided, "reason": decision.reason}
        self._write_status()
        try:
            self._carry_out_scale_out(decision, decided)
        finally:
            self.scaling = None
            self._write_status()

    def _carry_out_scale_out(self, decision: Decision, decided: float) -> None:
        rollback = self.partial_policy == "rollback_all"
        cancel = threading.Event()  # set: the pool abandons the starts still under way (EnginePool.add)
        futures = [_in_thread(self.pool.add, 1, cancel=cancel) for _ in range(decision.delta)]
        deadline = time.monotonic() + self.scale_out_timeout_s
        done: set[Future] = set()
        while len(done) < len(futures) and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # in short waits, so that stop() is heard; rollback_all gives up on the others at the first failure
            finished, _ = wait(futures, timeout=min(left, 0.5),
                               return_when=FIRST_EXCEPTION if rollback else ALL_COMPLETED)
            done = set(finished)
            if rollback and any(f.exception() is not None for f in done):
                break
        cancel.set()
        added: list[str] = []
        errors: list[str] = []
        for fut in futures:
            if fut not in done:
                continue
            if fut.exception() is not None:
                errors.append(str(fut.exception()))
                logger.warning("autoscaler: an engine of the scale-out did not come up: %s", fut.exception())
            else:
                added += fut.result()
        late = [fut for fut in futures if fut not in done]
        for fut in late:  # an engine whose start ends after this (the cancel came too late for it) leaves again
            fut.add_done_callback(self._remove_late)
        if late:
            logger.warning("autoscaler: %d engine(s) of the scale-out not up within %g s (--scale-out-timeout): "
                           "cancelled", len(late), self.scale_out_timeout_s)
        failed = len(errors) + len(late)
        outcome = {"requested": decision.delta, "failed": len(errors), "late": len(late), "errors": errors}
        if failed and rollback:
            for url in added:
                self.pool.remove(url)
            self._record("scale_out_rolled_back", -len(added),
                         f"{failed} of {decision.delta} engines failed or were not up within --scale-out-timeout "
                         f"(--scale-out-partial-success-policy rollback_all); for: {decision.reason}",
                         decided=decided, urls=[], rolled_back=added, **outcome)
            return
        self.last_scale_out = self.last_scale = time.monotonic()
        self.samples = []  # the old window described fewer engines
        self._record("scale_out", len(added), decision.reason, decided=decided, urls=added, **outcome)

    def _remove_late(self, fut: Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return  # the pool abandoned it (the usual case) or it failed: nothing joined
        urls = fut.result()
        for url in urls:
            try:
                self.pool.remove(url)
            except Exception as exc:  # already gone (shutdown)
                logger.warning("autoscaler: removing late engine %s: %s", url, exc)
        self._record("scale_out_late_removed", 0, f"{len(urls)} engine(s) came up after --scale-out-timeout and "
                     "were removed", urls=urls)

    def _scale_in(self, decision: Decision) -> None:
        decided = time.time()
        self.scaling = {"action": "scale_in", "delta": -decision.delta, "time": decided, "reason": decision.reason}
        self._write_status()
        try:
            newest = sorted(self.pool.list(), key=lambda e: e["id"], reverse=True)
            victims = [e["url"] for e in newest if e.get("state") == "active"][:decision.delta]
            drained = [self.pool.drain(url, self.drain_timeout_s) for url in victims]
            self.last_scale = time.monotonic()
            self.samples = []
            self._record("scale_in", -len(victims), decision.reason, decided=decided, urls=victims, drained=drained)
        finally:
            self.scaling = None
            self._write_status()

    def _record(self, action: str, delta: int, reason: str, decided: Optional[float] = None,
                **extra: Any) -> None:
        """A row of `decisions` and autoscaler.jsonl. `decided`: when a scaling that has now finished was decided
        (its row's `time`; `done_time` is now)."""
        now = time.time()
        timing = {"time": now} if decided is None else {"time": decided, "done_time": now,
                                                         "duration_s": round(now - decided, 3)}
        row = {**timing, "action": action, "delta": delta, "engines": len(self.pool.urls()), "reason": reason,
               **extra}
        with self._record_lock:
            self.decisions.append(row)
            self.decisions_total += 1
            if self.log_path is not None:
                with self.log_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
        if action not in ("scale_out", "scale_in"):  # a scaling's status follows once `scaling` is cleared
            self._write_status()
        if action != "hold":
            logger.warning("autoscaler: %s %+d -> %d engines: %s", action, delta, row["engines"], reason)
