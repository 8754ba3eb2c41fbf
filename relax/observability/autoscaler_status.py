"""The autoscaler's status file, OUTPUT_DIR/autoscaler_status.json: written, read and shown as text.

The autoscaler (relax/rollout/autoscaler.py, `Autoscaler.status()`) rewrites it after each observation, at the
start of a scaling and after each decision, atomically (a temporary file in the same folder, then `os.replace`),
so a reader never sees half a file. Its keys:

* `time` (Unix time of this status), `state` ("running" or "stopped"), `config` (the --autoscaler-config values:
  min/max engines, cooldowns, intervals, policies), `active_engines`;
* `engines`: one entry per engine of the pool: `id`, `url`, `state` (starting, syncing, active, draining, ...),
  `weight_version`, `started_at`, and the autoscaler's last reading of its `/metrics`: `metrics` (SGLang's names:
  `sglang:token_usage`, `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:gen_throughput` (generated
  tokens/s between the autoscaler's last two scrapes), `sglang:queue_time_seconds:p95` and
  `sglang:time_to_first_token_seconds:p95` (over the last scrape interval, where the engine exports those
  histograms)), `scraped_at` and `scrape_error` (the last scrape failed; `metrics` is then the one before);
* `last_sample`: the means over the active engines the decisions read (its `time` in Unix time);
* `scaling`: the scale-out or scale-in under way (action, delta, time decided, reason), null when none;
* `decisions`: the newest 500 decisions, oldest first, as the rows of OUTPUT_DIR/autoscaler.jsonl (which has
  every one: `time` decided, `action`, `delta`, `engines` after it, `reason`; a scaling's `done_time`,
  `duration_s`, `urls` and outcome); `decisions_total`: how many there were in all.

`relax-status RUN_DIR` (relax/entrypoints/status.py) prints it; the metrics service serves it at `/autoscaler`
with --use-metrics-service.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

STATUS_FILE = "autoscaler_status.json"
DECISIONS_FILE = "autoscaler.jsonl"

# the per-engine metrics shown, in order, with their short names
ENGINE_METRICS = (("sglang:token_usage", "usage", "{:.3f}"), ("sglang:num_running_reqs", "running", "{:g}"),
                  ("sglang:num_queue_reqs", "queued", "{:g}"), ("sglang:gen_throughput", "gen", "{:.1f} tok/s"),
                  ("sglang:queue_time_seconds:p95", "queue p95", "{:.2f} s"),
                  ("sglang:time_to_first_token_seconds:p95", "ttft p95", "{:.2f} s"))


class StatusFileError(Exception):
    """No readable status file: the message is the one line to show."""


def finite(obj: Any) -> Any:
    """`obj` with NaN and infinities as None (JSON has no such numbers)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_status(path: str | os.PathLike, status: dict[str, Any]) -> None:
    """Write `status` to `path` atomically: a reader sees the previous file or this one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(finite(status), indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def status_path(run: str | os.PathLike) -> Path:
    """The status file of run folder `run` (or `run` itself when it names a file)."""
    run = Path(run)
    return run if run.suffix == ".json" and not run.is_dir() else run / STATUS_FILE


def read_status_text(run: str | os.PathLike) -> tuple[Path, str]:
    """(path, text) of the status file of `run`; raises StatusFileError with the line to show."""
    path = status_path(run)
    if not path.parent.is_dir():
        raise StatusFileError(f"{path.parent}: no such folder (give the run's --output-dir)")
    if not path.is_file():
        hint = (f" ({DECISIONS_FILE} is there: the run predates the status file)"
                if (path.parent / DECISIONS_FILE).is_file() else "")
        raise StatusFileError(f"{path}: no autoscaler status; it is written by runs with --autoscaler-config "
                              f"once their engines are up{hint}")
    try:
        return path, path.read_text(encoding="utf-8")
    except OSError as exc:
        raise StatusFileError(f"{path}: cannot read: {exc.strerror or exc}") from None


def read_status(run: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    path, text = read_status_text(run)
    try:
        status = json.loads(text)
    except ValueError as exc:
        raise StatusFileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(status, dict) or not isinstance(status.get("decisions"), list):
        raise StatusFileError(f"{path}: not an autoscaler status (no list of decisions)")
    return path, status


# ------------------------------------------------------------------------------------------------ text
def _ago(then: Optional[float], now: float) -> str:
    if then is None:
        return "never"
    seconds = max(0.0, now - float(then))
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _clock(t: Optional[float], now: float) -> str:
    if t is None:
        return "?"
    local = time.localtime(t)
    same_day = time.localtime(now)[:3] == local[:3]
    return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M:%S", local)


def _engine_line(engine: dict[str, Any], now: float) -> str:
    parts = [f"#{engine.get('id', '?')}", f"{engine.get('state', '?'):<8}", str(engine.get("url") or "(no url yet)")]
    if engine.get("weight_version") is not None:
        parts.append(f"v{engine['weight_version']}")
    metrics = engine.get("metrics")
    if metrics:
        for key, label, fmt in ENGINE_METRICS:
            if key in metrics:
                value = metrics[key]
                parts.append(f"{label} {'-' if value is None else fmt.format(value)}")
        parts.append(f"(scraped {_ago(engine.get('scraped_at'), now)})")
    elif engine.get("state") == "active":
        parts.append("no metrics yet")
    if engine.get("scrape_error"):
        parts.append(f"last scrape failed: {engine['scrape_error']}")
    return "  " + "  ".join(parts)


def _outcome(row: dict[str, Any]) -> str:
    action = row.get("action")
    parts = []
    if action == "scale_out":
        parts.append(f"added {len(row.get('urls') or [])} of {row.get('requested', row.get('delta'))}")
    elif action == "scale_out_rolled_back":
        parts.append(f"rolled back {len(row.get('rolled_back') or [])}")
    elif action == "scale_in":
        drained = row.get("drained") or []
        parts.append(f"removed {len(row.get('urls') or [])}")
        if drained and not all(drained):
            parts.append(f"{sum(1 for d in drained if not d)} not drained in time")
    elif action == "scale_out_late_removed":
        parts.append(f"removed {len(row.get('urls') or [])}")
    if row.get("failed"):
        parts.append(f"{row['failed']} failed")
    if row.get("late"):
        parts.append(f"{row['late']} late")
    if row.get("duration_s") is not None:
        parts.append(f"in {row['duration_s']:g} s")
    return ", ".join(parts) if parts else "-"


def _engines_change(row: dict[str, Any]) -> str:
    after = row.get("engines")
    if not isinstance(after, int):
        return "?"
    delta = row.get("delta") or 0
    before = after if row.get("action") == "scale_out_rolled_back" else after - delta
    return str(after) if row.get("action") in ("hold", "error") else f"{before}->{after}"


def format_status(status: dict[str, Any], now: Optional[float] = None, last: int = 20,
                  source: str = "") -> str:
    """The status as text: a header, a line per engine, then the decisions newest first (the `last` ones; 0:
    all)."""
    now = time.time() if now is None else now
    cfg = status.get("config") or {}
    engines = status.get("engines") or []
    active = status.get("active_engines", sum(1 for e in engines if e.get("state") == "active"))
    scaling = status.get("scaling")
    if scaling:
        now_doing = (f"{scaling.get('action')} {scaling.get('delta', 0):+d}, decided "
                     f"{_ago(scaling.get('time'), now)} ({scaling.get('reason')})")
    else:
        now_doing = "no"
    state = status.get("state", "running")
    lines = [f"autoscaler{' of ' + source if source else ''}: {state}, updated {_ago(status.get('time'), now)}",
             f"engines: {active} active within [{cfg.get('min_engines', '?')}, {cfg.get('max_engines', '?')}]; "
             f"scaling now: {now_doing}",
             f"cooldowns: scale-out {cfg.get('scale_out_cooldown_secs', '?')} s, scale-in "
             f"{cfg.get('scale_in_cooldown_secs', '?')} s; metrics every {cfg.get('metrics_interval_secs', '?')} s, "
             f"decisions every {cfg.get('evaluation_interval_secs', '?')} s"]
    sample = status.get("last_sample")
    if sample:
        throughput = sample.get("throughput")
        lines.append(f"load (means over the active engines, {_ago(sample.get('time'), now)}): usage "
                     f"{sample.get('token_usage', 0):.3f}, queue/engine {sample.get('queue_per_engine', 0):.1f}, "
                     f"{'-' if throughput is None else f'{throughput:.1f}'} tok/s in all")
    lines += [_engine_line(e, now) for e in engines] or ["  (no engines)"]
    decisions = list(status.get("decisions") or [])
    shown = decisions if last <= 0 else decisions[-last:]
    total = max(len(decisions), int(status.get("decisions_total") or 0))
    header = f"decisions, newest first ({len(shown)} of {total}"
    if len(shown) < len(decisions):
        header += "; --last 0 for all" if len(decisions) == total else "; --last 0 for the kept ones"
    if len(decisions) < total:
        header += f"; every one in {DECISIONS_FILE}"
    lines.append(header + "):")
    for row in reversed(shown):
        lines.append(f"  {_clock(row.get('time'), now)}  {row.get('action', '?'):<21} {_engines_change(row):>6}  "
                     f"{row.get('reason', '')}  [{_outcome(row)}]")
    if not decisions:
        lines.append("  (none yet)")
    return "\n".join(lines)
