"""The roles' side of the metrics service (relax/observability/metrics_service.py), and Prometheus text parsing.

`MetricsReporter(enabled).report(role, rank, metrics, step)` sends one report to the run's service actor and
returns at once: the call is a fire-and-forget actor task (`.remote()` whose result nobody waits for), so a
slow or busy service never slows a role's step. Calls from one process reach the service in the order they
were made (Ray keeps the order of one caller's tasks to a non-threaded actor). With the service disabled,
or outside Ray, `report` does nothing. If the service falls behind by more than `max_pending` reports from
one process, new reports are dropped (and counted in `dropped`) rather than queued without bound.

`step_record(step, expect=...)` is the controller's read of one step's merged metrics. It waits (polling,
off the roles' hot path) until the roles it names have reported that step, because reports from different
processes arrive in no fixed order relative to the calls that return the same step's results.

`parse_prometheus_text` reads the Prometheus text exposition format (what SGLang's `/metrics` serves, and
what the service serves); `scrape_engine_metrics(url, api_key)` fetches an engine's `/metrics` and returns
`{key: value}` where a sample with labels gets the key `name{label="value",...}` (labels sorted), a form the
service turns back into Prometheus labels.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import ray
import requests

from relax.wire.auth import auth_headers

logger = logging.getLogger(__name__)

SERVICE_NAME = "relax-metrics-service"
LOOKUP_RETRY_S = 5.0  # between two look-ups of a service that was not found (each is a call to Ray's GCS)

_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def plain(value: Any) -> Any:
    """A value as the service stores it: numbers, bools, strings and lists of them (tensors, numpy scalars
    and arrays are converted here, so the service never needs torch or numpy to read a report)."""
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) > 0:
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (bool, int, float, str)):
        value = value.item()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


class MetricsReporter:
    """Reports of one process (a role, the controller) to the run's metrics service."""

    def __init__(self, enabled: bool, *, name: str = SERVICE_NAME, namespace: str | None = None,
                 max_pending: int = 1000):
        self.enabled = bool(enabled)
        self.name = name
        self.namespace = namespace
        self.max_pending = max_pending
        self.dropped = 0  # reports given up because the service was missing or too far behind
        self._handle = None
        self._next_lookup = 0.0
        self._pending: list[Any] = []

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> "MetricsReporter":
        return cls(bool(getattr(config, "use_metrics_service", False)), **kwargs)

    # -- the hot path ------------------------------------------------------------------------
    def report(self, role: str, rank: int | str, metrics: Mapping[str, Any], step: int | None = None) -> bool:
        """Send `metrics` of (`role`, `rank`) for `step` (None: current values only). Never waits for the
        service; returns whether the report was sent."""
        if not self.enabled or not metrics:
            return False
        handle = self._service()
        if handle is None or not self._room():
            self.dropped += 1
            return False
        values = {str(k): plain(v) for k, v in metrics.items()}
        self._pending.append(handle.report.remote(str(role), str(rank), values, step, time.time()))
        return True

    def watch_engine(self, role: str, rank: int | str, url: str) -> bool:
        """Ask the service to scrape `url`/metrics in its own thread from now on (engines serving Prometheus
        text: SGLang with `--enable-metrics`). Fire-and-forget like `report`; returns whether it was sent."""
        handle = self._service() if self.enabled else None
        if handle is None:
            return False
        self._pending.append(handle.watch.remote(str(role), str(rank), url))
        return True

    def publish(self, name: str, document: Any) -> bool:
        """Have the service serve `document` (JSON) at /`name` (the autoscaler's status: /autoscaler) until the
        next one. Fire-and-forget like `report`; returns whether it was sent."""
        if not self.enabled:
            return False
        handle = self._service()
        if handle is None or not self._room():
            self.dropped += 1
            return False
        self._pending.append(handle.publish.remote(str(name), document))
        return True

    def _room(self) -> bool:
        """Whether fewer than `max_pending` reports of this process are still unprocessed. Only looked at once
        the list is full, and then with `ray.wait(timeout=0)`, which returns at once."""
        if len(self._pending) < self.max_pending:
            return True
        _, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0,
                                    fetch_local=False)
        return len(self._pending) < self.max_pending

    def _service(self):
        if self._handle is not None:
            return self._handle
        now = time.monotonic()
        if now < self._next_lookup or not ray.is_initialized():
            return None
        try:
            self._handle = ray.get_actor(self.name, namespace=self.namespace)
        except ValueError:  # not started (yet), or already gone
            self._next_lookup = now + LOOKUP_RETRY_S
            logger.warning("metrics service %r not found; reports are dropped until it is", self.name)
            return None
        return self._handle

    # -- reads (controller, tests): these wait ---------------------------------------------------
    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until the service has processed every report this process sent (tests, shutdown)."""
        if self._pending:
            ray.wait(self._pending, num_returns=len(self._pending), timeout=timeout_s, fetch_local=False)
            self._pending = []

    def step_record(self, step: int, expect: Mapping[str, int] | None = None, timeout_s: float = 10.0,
                    poll_s: float = 0.05) -> dict[str, Any] | None:
        """The merged record of `step` (see MetricsStore.step_record), None when disabled or never reported.

        `expect` maps a role to how many of its ranks must have reported `step` before the record is
        returned: the wait ends when they have, or after `timeout_s` (then with what has arrived, and a
        warning naming the missing roles)."""
        if not self.enabled:
            return None
        self.flush(timeout_s)  # this process's own reports first
        handle = self._service()
        if handle is None:
            return None
        deadline = time.monotonic() + timeout_s
        while True:
            record = ray.get(handle.step_record.remote(step), timeout=timeout_s)
            missing = _missing_sources(record, expect)
            if not missing:
                return record
            if time.monotonic() >= deadline:
                logger.warning("metrics service: step %d still lacks reports of %s after %.1fs", step,
                               ", ".join(missing), timeout_s)
                return record
            time.sleep(poll_s)


def _missing_sources(record: dict[str, Any] | None, expect: Mapping[str, int] | None) -> list[str]:
    if not expect:
        return []
    ranks: dict[str, int] = {}
    for source in (record or {}).get("sources", {}):
        role = source.rsplit("/", 1)[0]
        ranks[role] = ranks.get(role, 0) + 1
    return [f"{role} ({ranks.get(role, 0)}/{n})" for role, n in expect.items() if ranks.get(role, 0) < n]


# ------------------------------------------------------------------------------------------ Prometheus text
@dataclass
class Sample:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    value: float = 0.0


def parse_prometheus_text(text: str) -> tuple[list[Sample], dict[str, str]]:
    """The samples of a Prometheus text exposition and the `# TYPE` of each metric family. Comments other than
    TYPE (HELP, OpenMetrics' `# EOF`) are skipped; a sample's optional timestamp is ignored. Raises ValueError
    with the line number on a malformed line."""
    samples: list[Sample] = []
    types: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                types[parts[2]] = parts[3].strip()
            continue
        try:
            samples.append(_parse_sample(line))
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}: {raw!r}") from None
    return samples, types


def _parse_sample(line: str) -> Sample:
    match = _NAME_RE.match(line)
    if match is None:
        raise ValueError("no metric name")
    name, pos = match.group(0), match.end()
    labels: dict[str, str] = {}
    if pos < len(line) and line[pos] == "{":
        labels, pos = _parse_labels(line, pos + 1)
    rest = line[pos:].split()
    if not rest or len(rest) > 2 or (pos < len(line) and not line[pos].isspace()):
        raise ValueError("expected `name{labels} value [timestamp]`")
    return Sample(name, labels, parse_value(rest[0]))


def _parse_labels(line: str, pos: int) -> tuple[dict[str, str], int]:
    """Labels from just after `{` to the closing `}`; returns them and the position after `}`."""
    labels: dict[str, str] = {}
    while True:
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if pos < len(line) and line[pos] == "}":
            return labels, pos + 1
        match = _LABEL_NAME_RE.match(line, pos)
        if match is None or line[match.end():match.end() + 2] != '="':
            raise ValueError("bad label")
        pos = match.end() + 2
        chars: list[str] = []
        while True:
            if pos >= len(line):
                raise ValueError("unterminated label value")
            ch = line[pos]
            if ch == "\\":
                if pos + 1 >= len(line):
                    raise ValueError("unterminated escape")
                chars.append(_ESCAPES.get(line[pos + 1], "\\" + line[pos + 1]))
                pos += 2
            elif ch == '"':
                pos += 1
                break
            else:
                chars.append(ch)
                pos += 1
        labels[match.group(0)] = "".join(chars)
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if pos < len(line) and line[pos] == ",":
            pos += 1
        elif pos < len(line) and line[pos] != "}":
            raise ValueError("expected `,` or `}` after a label")


def parse_value(text: str) -> float:
    """A sample value: a float, `NaN`, `+Inf`, `-Inf` (Go's spellings, which Python's float also reads)."""
    value = float(text)  # raises ValueError on anything else
    if math.isnan(value) and text.lower() not in ("nan", "+nan", "-nan"):
        raise ValueError(f"bad value {text!r}")
    return value


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metric_key(name: str, labels: Mapping[str, str]) -> str:
    """`name`, or `name{a="x",b="y"}` (labels sorted) when it has labels: one dict key per series."""
    if not labels:
        return name
    body = ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in sorted(labels.items()))
    return f"{name}{{{body}}}"


def split_metric_key(key: str) -> tuple[str, dict[str, str]]:
    """The inverse of `metric_key`: (`name`, labels). A key that does not end in a valid label set is a plain
    name (so `train/loss` or `a{b` come back unchanged, with no labels)."""
    brace = key.find("{")
    if brace <= 0 or not key.endswith("}"):
        return key, {}
    try:
        labels, end = _parse_labels(key, brace + 1)
    except ValueError:
        return key, {}
    if end != len(key):
        return key, {}
    return key[:brace], labels


def scrape_engine_metrics(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> dict[str, float]:
    """`GET {url}/metrics` of an engine (SGLang with `--enable-metrics`, or any Prometheus endpoint) as
    `{metric_key(name, labels): value}`. `api_key` (the run's engine key; SGLang's `--api-key` guards all but
    its health endpoints) is sent as a bearer token. Raises requests' errors and ValueError (bad text)."""
    target = url.rstrip("/")
    if not target.endswith("/metrics"):
        target += "/metrics"
    resp = requests.get(target, headers=auth_headers(api_key) if api_key else {}, timeout=timeout_s)
    resp.raise_for_status()
    samples, _ = parse_prometheus_text(resp.text)
    return {metric_key(s.name, s.labels): s.value for s in samples}
