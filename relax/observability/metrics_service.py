"""The metrics service (`--use-metrics-service`): one Ray actor that every role reports to, served over HTTP.

It holds the current value of every metric by (role, rank or instance, name) and a record per step, and
serves them from a small HTTP server in a thread of the actor:

* `GET /metrics`: Prometheus text exposition format. Every metric is a gauge named `relax_<name>` with the
  name sanitised to `[a-zA-Z_:][a-zA-Z0-9_:]*` (`train/loss` -> `relax_train_loss`), labelled `role`,
  `rank` and, when the value came with one, `step`. A list-valued metric is exported as `<name>/mean`,
  `/p50`, `/p90` and `/max` (as for TensorBoard); strings are left out. A key written `name{a="x"}` (what
  `scrape_engine_metrics` returns for an engine's labelled samples) keeps its labels (a label that clashes
  with role/rank/step is renamed `exported_<label>`, as Prometheus does). The service's own counters:
  `relax_metrics_service_reports_total{role}`, `relax_metrics_service_last_report_timestamp_seconds{role,rank}`
  and `relax_metrics_service_scrape_errors_total{role,rank}`.
* `GET /metrics.json`: the current values, `{"latest_step": N, "current": [{role, rank, name, value, step,
  time}, ...]}`.
* `GET /steps?since=N[&limit=M]`: the records of steps >= N (all when absent), oldest first:
  `{"steps": [{"step", "metrics", "sources", "time"}, ...], "latest_step": N}`. `sources` maps
  "role/rank" to what that source reported for the step; `metrics` merges them (a name reported by several
  sources takes the value of the first in (role, rank) order, e.g. trainer rank 0).
* `GET /autoscaler`: the autoscaler's status with --autoscaler-config, the same JSON as
  OUTPUT_DIR/autoscaler_status.json (relax/observability/autoscaler_status.py): the rollout manager publishes each
  status it writes (`publish("autoscaler", status)`); 404 while there is none.
* `GET /health`.

The server binds loopback while the Ray cluster is one node (the rule engines follow, relax/roles/engine.py)
and the node's address when roles span nodes; the port is taken by binding port 0, so no other process can
take it in between. `start_metrics_service` creates the actor (named, in the run's namespace, on the driver's
node, ended with the job) and writes its URL to OUTPUT_DIR/metrics_service.url.

Engines that serve Prometheus text (SGLang with `--enable-metrics`) can be watched by the service itself:
`watch(role, rank, url)` scrapes `url/metrics` every `scrape_interval_s` in a background thread with the
run's engine key, so no role spends time on it.

Roles report through `relax.observability.metrics_client.MetricsReporter`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import parse_qs, urlparse

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from relax.wire.auth import ENGINE_API_KEY_ENV, engine_api_key
from relax.config.env import role_runtime_env
from relax.observability.autoscaler_status import finite
from relax.observability.metrics import summarise
from relax.observability.metrics_client import (
    SERVICE_NAME,
    escape_label_value,
    scrape_engine_metrics,
    split_metric_key,
)

logger = logging.getLogger(__name__)

PREFIX = "relax_"
URL_FILE = "metrics_service.url"
RESERVED_LABELS = ("role", "rank", "step")
# the service's own series; a reported metric exporting under one of these names is left out
OWN_NAMES = frozenset(PREFIX + n for n in ("metrics_service_reports_total",
                                           "metrics_service_last_report_timestamp_seconds",
                                           "metrics_service_scrape_errors_total"))
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_INVALID_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_:]")
_INVALID_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_name(name: str) -> str:
    """`relax_` + `name` with every character outside [a-zA-Z0-9_:] replaced by `_` (the prefix makes the
    first character valid)."""
    return PREFIX + _INVALID_NAME_CHARS.sub("_", name)


def prometheus_label_name(name: str) -> str:
    out = _INVALID_LABEL_CHARS.sub("_", name) or "_"
    if out[0].isdigit():
        out = "_" + out
    if out.startswith("__"):  # reserved for Prometheus itself
        out = "x" + out
    return out


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _numbers(name: str, value: Any) -> dict[str, float]:
    """The numbers a stored value exports: itself, a list's summary, nothing for strings."""
    if isinstance(value, bool):
        return {name: 1.0 if value else 0.0}
    if isinstance(value, (int, float)):
        return {name: float(value)}
    if isinstance(value, list):
        return summarise(name, value)
    return {}


def _rank_order(source: tuple[str, str]) -> tuple[str, int, str]:
    role, rank = source
    return (role, int(rank), "") if rank.isdigit() else (role, 1 << 62, rank)


class MetricsStore:
    """Current values and per-step records; thread-safe (the actor's methods and the HTTP threads share it)."""

    def __init__(self, keep_steps: int = 10000):
        self.keep_steps = keep_steps
        self._lock = threading.Lock()
        # (role, rank, name) -> {"value", "step", "time"}
        self._current: dict[tuple[str, str, str], dict[str, Any]] = {}
        # step -> {(role, rank): {name: value}}; and the time of each step's last report
        self._steps: dict[int, dict[tuple[str, str], dict[str, Any]]] = {}
        self._step_time: dict[int, float] = {}
        self._reports: dict[str, int] = {}
        self._last_report: dict[tuple[str, str], float] = {}
        self._scrape_errors: dict[tuple[str, str], int] = {}
        self._documents: dict[str, Any] = {}  # name -> the last JSON document published under it

    def report(self, role: str, rank: str, metrics: Mapping[str, Any], step: int | None = None,
               when: float | None = None) -> None:
        when = time.time() if when is None else when
        role, rank = str(role), str(rank)
        with self._lock:
            for name, value in metrics.items():
                self._current[(role, rank, name)] = {"value": value, "step": step, "time": when}
            if step is not None:
                step = int(step)
                self._steps.setdefault(step, {}).setdefault((role, rank), {}).update(metrics)
                self._step_time[step] = when
                while len(self._steps) > self.keep_steps:
                    oldest = min(self._steps)
                    del self._steps[oldest]
                    self._step_time.pop(oldest, None)
            self._reports[role] = self._reports.get(role, 0) + 1
            self._last_report[(role, rank)] = when

    def set_document(self, name: str, document: Any) -> None:
        """Keep `document` as the current `name` document (e.g. "autoscaler", served at /autoscaler)."""
        with self._lock:
            self._documents[str(name)] = document

    def document(self, name: str) -> Any:
        with self._lock:
            return self._documents.get(name)

    def scrape_failed(self, role: str, rank: str) -> int:
        """Count a failed scrape of (role, rank); returns how many there have been."""
        with self._lock:
            self._scrape_errors[(role, rank)] = self._scrape_errors.get((role, rank), 0) + 1
            return self._scrape_errors[(role, rank)]

    # -- reads -----------------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        with self._lock:
            return max(self._steps) if self._steps else None

    def _record(self, step: int) -> dict[str, Any]:
        sources = self._steps[step]
        merged: dict[str, Any] = {}
        for source in sorted(sources, key=_rank_order):
            for name, value in sources[source].items():
                merged.setdefault(name, value)
        return {"step": step, "metrics": dict(sorted(merged.items())),
                "sources": {f"{role}/{rank}": dict(values) for (role, rank), values in
                            sorted(sources.items(), key=lambda item: _rank_order(item[0]))},
                "time": self._step_time.get(step)}

    def step_record(self, step: int) -> dict[str, Any] | None:
        with self._lock:
            return self._record(int(step)) if int(step) in self._steps else None

    def steps(self, since: int | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        with self._lock:
            chosen = sorted(s for s in self._steps if since is None or s >= since)
            if limit is not None:
                chosen = chosen[:limit]
            return [self._record(s) for s in chosen]

    def current(self) -> list[dict[str, Any]]:
        with self._lock:
            items = sorted(self._current.items(), key=lambda kv: (_rank_order(kv[0][:2]), kv[0][2]))
            return [{"role": role, "rank": rank, "name": name, **entry} for (role, rank, name), entry in items]

    def prometheus_text(self) -> str:
        """The current values in Prometheus text exposition format (version 0.0.4)."""
        families: dict[str, dict[str, Any]] = {}  # exported name -> {"help": [...], "samples": {labels: value}}
        for entry in self.current():
            base, extra = split_metric_key(entry["name"])
            for name, number in _numbers(base, entry["value"]).items():
                labels = {"role": entry["role"], "rank": entry["rank"]}
                if entry["step"] is not None:
                    labels["step"] = str(entry["step"])
                for key, val in extra.items():
                    key = prometheus_label_name(key)
                    labels[f"exported_{key}" if key in RESERVED_LABELS else key] = val
                if prometheus_name(name) in OWN_NAMES:
                    continue
                family = families.setdefault(prometheus_name(name), {"help": [], "samples": {}})
                if name not in family["help"]:
                    family["help"].append(name)
                # a series is its labels without the step (a new step replaces it); when two names export as
                # one (`a/b` and `a_b`), the first in sorted order is kept so the text stays valid
                series = tuple(sorted((k, v) for k, v in labels.items() if k != "step"))
                family["samples"].setdefault(series, (labels, number))
        lines: list[str] = []
        for exported in sorted(families):
            family = families[exported]
            help_text = ", ".join(family["help"]).replace("\\", "\\\\").replace("\n", "\\n")
            lines += [f"# HELP {exported} {help_text}", f"# TYPE {exported} gauge"]
            lines += [f"{exported}{_label_text(labels)} {format_value(value)}"
                      for labels, value in family["samples"].values()]
        lines += self._own_metrics()
        return "\n".join(lines) + "\n"

    def _own_metrics(self) -> list[str]:
        with self._lock:
            reports = dict(self._reports)
            last = dict(self._last_report)
            errors = dict(self._scrape_errors)
        name = PREFIX + "metrics_service_reports_total"
        lines = [f"# HELP {name} Reports received, by role.", f"# TYPE {name} counter"]
        lines += [f"{name}{_label_text({'role': r})} {n}" for r, n in sorted(reports.items())]
        name = PREFIX + "metrics_service_last_report_timestamp_seconds"
        lines += [f"# HELP {name} Unix time of the last report of each source.", f"# TYPE {name} gauge"]
        lines += [f"{name}{_label_text({'role': r, 'rank': k})} {format_value(t)}"
                  for (r, k), t in sorted(last.items())]
        name = PREFIX + "metrics_service_scrape_errors_total"
        lines += [f"# HELP {name} Failed scrapes of watched engines.", f"# TYPE {name} counter"]
        lines += [f"{name}{_label_text({'role': r, 'rank': k})} {n}" for (r, k), n in sorted(errors.items())]
        return lines


def _label_text(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in labels.items()) + "}"


# ------------------------------------------------------------------------------------------------ HTTP
class _Handler(BaseHTTPRequestHandler):
    store: MetricsStore  # set on the subclass the server is built with

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        url = urlparse(self.path)
        try:
            if url.path == "/metrics":
                self._send(200, self.store.prometheus_text(), PROMETHEUS_CONTENT_TYPE)
            elif url.path == "/metrics.json":
                self._json({"latest_step": self.store.latest_step(), "current": self.store.current()})
            elif url.path == "/steps":
                query = parse_qs(url.query)
                since = _int_param(query, "since")
                limit = _int_param(query, "limit")
                self._json({"steps": self.store.steps(since, limit), "latest_step": self.store.latest_step()})
            elif url.path == "/autoscaler":
                status = self.store.document("autoscaler")
                if status is None:
                    self._send(404, "no autoscaler status: the run needs --autoscaler-config, and its engines must "
                               "be up\n", "text/plain; charset=utf-8")
                else:
                    self._json(status)
            elif url.path == "/health":
                self._send(200, "ok\n", "text/plain; charset=utf-8")
            else:
                self._send(404, "not found; try /metrics, /metrics.json, /steps?since=N, /autoscaler, /health\n",
                           "text/plain; charset=utf-8")
        except ValueError as exc:
            self._send(400, f"{exc}\n", "text/plain; charset=utf-8")

    def _json(self, obj: Any) -> None:
        # NaN/Infinity are not JSON: sent as null so that every client can parse the answer
        self._send(200, json.dumps(finite(obj)), "application/json")

    def _send(self, status: int, body: str, content_type: str) -> None:
        data = body.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - each scrape would be a log line
        logger.debug("metrics service: " + format, *args)


def _int_param(query: dict[str, list[str]], name: str) -> int | None:
    if name not in query:
        return None
    try:
        return int(query[name][-1])
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {query[name][-1]!r}") from None


def bind_host() -> str:
    """Loopback while the Ray cluster is this one node, the node's address when it spans nodes (as engines)."""
    if not ray.is_initialized():
        return "127.0.0.1"
    alive = [node for node in ray.nodes() if node.get("Alive")]
    return ray.util.get_node_ip_address() if len(alive) > 1 else "127.0.0.1"


def serve(store: MetricsStore, host: str, port: int = 0) -> ThreadingHTTPServer:
    """An HTTP server for `store` on (`host`, `port`; 0: a free one), serving from a daemon thread."""
    handler = type("MetricsHandler", (_Handler,), {"store": store})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="relax-metrics-http", daemon=True).start()
    return server


# ------------------------------------------------------------------------------------------------ the actor
class MetricsService:
    """The body of the service actor (`ray.remote` is applied in `start_metrics_service`, so that tests can
    wrap a subclass). Runs one method at a time, which keeps each caller's reports in order."""

    def __init__(self, host: str | None = None, port: int = 0, keep_steps: int = 10000,
                 scrape_interval_s: float = 5.0):
        self.store = MetricsStore(keep_steps)
        self.server = serve(self.store, host or bind_host(), port)
        self.scrape_interval_s = scrape_interval_s
        self._targets: dict[tuple[str, str], str] = {}
        self._targets_lock = threading.Lock()
        self._stop = threading.Event()
        self._scraper: threading.Thread | None = None

    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def report(self, role: str, rank: str, metrics: dict[str, Any], step: int | None = None,
               when: float | None = None) -> None:
        self.store.report(role, rank, metrics, step, when)

    def step_record(self, step: int) -> dict[str, Any] | None:
        return self.store.step_record(step)

    def steps(self, since: int | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        return self.store.steps(since, limit)

    def current(self) -> list[dict[str, Any]]:
        return self.store.current()

    def publish(self, name: str, document: Any) -> None:
        """Serve `document` (JSON) as /`name` from now on (the autoscaler's status: /autoscaler)."""
        self.store.set_document(name, document)

    def watch(self, role: str, rank: str | int, url: str) -> None:
        """Scrape `url`/metrics every scrape_interval_s (first scrape now) as the current values of
        (`role`, `rank`), with the run's engine key; a failed scrape is counted and logged once per target."""
        with self._targets_lock:
            self._targets[(str(role), str(rank))] = url
        self._scrape_one((str(role), str(rank)), url, first=True)
        if self._scraper is None:
            self._scraper = threading.Thread(target=self._scrape_loop, name="relax-metrics-scrape", daemon=True)
            self._scraper.start()

    def unwatch(self, role: str, rank: str | int) -> None:
        with self._targets_lock:
            self._targets.pop((str(role), str(rank)), None)

    def _scrape_loop(self) -> None:
        while not self._stop.wait(self.scrape_interval_s):
            with self._targets_lock:
                targets = list(self._targets.items())
            for source, url in targets:
                self._scrape_one(source, url)

    def _scrape_one(self, source: tuple[str, str], url: str, first: bool = False) -> None:
        try:
            values = scrape_engine_metrics(url, engine_api_key())
        except Exception as exc:  # an engine restarting or gone: counted, the service goes on
            if self.store.scrape_failed(*source) == 1 or first:
                logger.warning("metrics service: scraping %s (%s/%s) failed: %s", url, *source, exc)
            return
        self.store.report(source[0], source[1], values)

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()


def start_metrics_service(output_dir: str | os.PathLike | None = None, *, name: str = SERVICE_NAME,
                          cls: type = MetricsService, num_cpus: float = 0.1, **kwargs: Any):
    """Create the service actor (named `name` in this job's namespace, on this node, ended with the job),
    wait for its server, write its URL to `output_dir`/metrics_service.url and log it. Returns (handle, url)."""
    key = engine_api_key()
    actor = ray.remote(cls).options(
        name=name, namespace=ray.get_runtime_context().namespace, lifetime=None, num_cpus=num_cpus,
        max_concurrency=1, max_restarts=0,
        # the run's engine key for scraping engines, handed on explicitly: a Ray started elsewhere (RAY_ADDRESS)
        # carries no job environment
        runtime_env=role_runtime_env({ENGINE_API_KEY_ENV: key}) if key else None,
        # on the driver's node, where OUTPUT_DIR (and the URL written there) is
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True),
    ).remote(**kwargs)
    url = ray.get(actor.url.remote(), timeout=60)
    if output_dir is not None:
        path = Path(output_dir) / URL_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(url + "\n", encoding="utf-8")
    logger.info("metrics service at %s (Prometheus: %s/metrics, JSON: %s/metrics.json, %s/steps?since=N)",
                url, url, url, url)
    return actor, url


def stop_metrics_service(actor, timeout_s: float = 10.0) -> None:
    """Close the server and end the actor."""
    try:
        ray.get(actor.close.remote(), timeout=timeout_s)
    except Exception as exc:  # already dead: the kill below is what matters
        logger.debug("metrics service close: %s", exc)
    ray.kill(actor, no_restart=True)
