"""PNG plots of a run's metrics.jsonl (`relax-plot RUN_DIR`, relax/entrypoints/plot.py).

One file per view, plus `overview.png` with all of them:

* reward.png: `rollout/reward_mean` with a +-`rollout/reward_std` band, and evaluation rewards (`eval/*reward*`)
* response_length.png: `rollout/response_len_*`
* loss.png: `train/loss`, `train/pg_loss` and the other `train/*loss*` (not `train/loss_scale`)
* kl.png: `train/kl`, `train/approx_kl` and the other `train/*kl*`
* step_time.png: each step's wall time split into rollout, train, weight sync, save and the rest
  (`perf/step_time` minus those), from the `perf/*_time` metrics the controller writes

A view whose metrics the run did not log is skipped and named. Figures are drawn with matplotlib's Agg
canvas directly (no pyplot, no display needed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

METRICS_FILE = "metrics.jsonl"
# (label, key) of the phases of one step, in the controller's order (relax/core/controller.py `_loop`)
STEP_PHASES = (("rollout", "perf/rollout_time"), ("train", "perf/train_time"),
               ("weight sync", "perf/weight_sync_time"), ("save", "perf/save_time"))
STEP_TIME = "perf/step_time"


class MetricsFileError(ValueError):
    """metrics.jsonl is missing, empty or has a line that is not a step record; the message names file and line."""


def metrics_path(run: str | Path) -> Path:
    """RUN_DIR/metrics.jsonl, or `run` itself when it is a file."""
    run = Path(run)
    return run if run.is_file() else run / METRICS_FILE


def load_records(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The step records of a metrics.jsonl and notes about what was skipped.

    A last line without its newline that does not parse is skipped with a note (a running or killed run may be
    writing it); any other line that is not a JSON object with an integer "step" is an error naming the line."""
    path = Path(path)
    if not path.exists():
        raise MetricsFileError(f"{path}: not found (relax-train writes {METRICS_FILE} into its --output-dir)")
    if not path.is_file():
        raise MetricsFileError(f"{path}: not a file")
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    records, notes = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n"):
                notes.append(f"{path}:{number}: skipped an incomplete last line (the run may still be writing it)")
                continue
            raise MetricsFileError(f"{path}:{number}: not valid JSON ({exc.msg}, column {exc.colno})") from None
        if not isinstance(record, dict) or isinstance(record.get("step"), bool) \
                or not isinstance(record.get("step"), int):
            raise MetricsFileError(f"{path}:{number}: expected a JSON object with an integer \"step\", got "
                                   f"{_short(line)}")
        records.append(record)
    if not records:
        raise MetricsFileError(f"{path}: empty (no step was logged)")
    return records, notes


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` in the records that have it as a finite number (a list counts as its mean)."""
    steps, values = [], []
    for record in records:
        value = _number(record.get(key))
        if value is not None:
            steps.append(record["step"])
            values.append(value)
    return steps, values


def _number(value: Any) -> float | None:
    if isinstance(value, (list, tuple)):
        nums = [float(v) for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
        value = sum(nums) / len(nums) if nums else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _keys(records: list[dict[str, Any]], keep: Callable[[str], bool], first: tuple[str, ...] = ()) -> list[str]:
    """The keys of the records that `keep` accepts and that hold numbers, `first` ones first."""
    seen = {k for r in records for k, v in r.items() if _number(v) is not None}
    found = [k for k in first if k in seen]
    return found + sorted(k for k in seen if keep(k) and k not in found)


def _lines(ax: Axes, records: list[dict[str, Any]], keys: list[str]) -> bool:
    drawn = False
    for key in keys:
        steps, values = series(records, key)
        if steps:
            ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3, label=key)
            drawn = True
    return drawn


def draw_reward(ax: Axes, records: list[dict[str, Any]]) -> bool:
    steps, mean = series(records, "rollout/reward_mean")
    drawn = False
    if steps:
        ax.plot(steps, mean, marker="o" if len(steps) <= 30 else None, markersize=3, label="rollout/reward_mean")
        std = dict(zip(*series(records, "rollout/reward_std")))
        if std:
            lo = [m - std.get(s, 0.0) for s, m in zip(steps, mean)]
            hi = [m + std.get(s, 0.0) for s, m in zip(steps, mean)]
            ax.fill_between(steps, lo, hi, alpha=0.2, label="+- rollout/reward_std")
        drawn = True
    evals = _keys(records, lambda k: k.startswith("eval/") and "reward" in k and not k.endswith("_std"))
    drawn = _lines(ax, records, evals) or drawn
    ax.set_ylabel("reward")
    return drawn


def draw_response_length(ax: Axes, records: list[dict[str, Any]]) -> bool:
    keys = _keys(records, lambda k: k.startswith("rollout/response_len"), first=("rollout/response_len_mean",))
    ax.set_ylabel("tokens")
    return _lines(ax, records, keys)


def draw_loss(ax: Axes, records: list[dict[str, Any]]) -> bool:
    keys = _keys(records, lambda k: k.startswith("train/") and "loss" in k and k != "train/loss_scale",
                 first=("train/loss", "train/pg_loss"))
    ax.set_ylabel("loss")
    return _lines(ax, records, keys)


def draw_kl(ax: Axes, records: list[dict[str, Any]]) -> bool:
    keys = _keys(records, lambda k: k.startswith("train/") and "kl" in k.split("/", 1)[1].split("_"),
                 first=("train/kl", "train/approx_kl"))
    ax.set_ylabel("KL")
    return _lines(ax, records, keys)


def step_time_breakdown(records: list[dict[str, Any]]) -> tuple[list[int], dict[str, list[float]]]:
    """(steps, phase label -> seconds per step) for the steps that logged perf/step_time; "other" is the rest."""
    steps: list[int] = []
    phases: dict[str, list[float]] = {label: [] for label, _ in STEP_PHASES}
    phases["other"] = []
    for record in records:
        total = _number(record.get(STEP_TIME))
        if total is None:
            continue
        steps.append(record["step"])
        used = 0.0
        for label, key in STEP_PHASES:
            seconds = max(0.0, _number(record.get(key)) or 0.0)
            phases[label].append(seconds)
            used += seconds
        phases["other"].append(max(0.0, total - used))
    return steps, phases


def draw_step_time(ax: Axes, records: list[dict[str, Any]]) -> bool:
    steps, phases = step_time_breakdown(records)
    if not steps:
        return False
    bottom = [0.0] * len(steps)
    for label, seconds in phases.items():
        if not any(seconds):
            continue
        if len(steps) <= 60:
            ax.bar(steps, seconds, bottom=bottom, label=label, width=0.8)
        else:  # bars of hundreds of steps are slivers; a stacked area reads better
            ax.fill_between(steps, bottom, [b + s for b, s in zip(bottom, seconds)], label=label, step="mid")
        bottom = [b + s for b, s in zip(bottom, seconds)]
    ax.set_ylabel("seconds per step")
    return True


# file stem -> (title, drawing function)
VIEWS: dict[str, tuple[str, Callable[[Axes, list[dict[str, Any]]], bool]]] = {
    "reward": ("Reward", draw_reward),
    "response_length": ("Response length", draw_response_length),
    "loss": ("Loss", draw_loss),
    "kl": ("KL", draw_kl),
    "step_time": ("Step time breakdown", draw_step_time),
}


def _finish(ax: Axes, title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("rollout step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)


def plot_run(run: str | Path, out_dir: str | Path | None = None) -> tuple[list[Path], list[str]]:
    """Writes the PNGs of a run (default into RUN_DIR/plots); returns (written files, notes on what was skipped).
    Raises MetricsFileError for a missing, empty or malformed metrics.jsonl."""
    path = metrics_path(run)
    records, notes = load_records(path)
    out = Path(out_dir) if out_dir is not None else path.parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    title_of = path.parent.name
    written, drawn = [], []
    for stem, (title, draw) in VIEWS.items():
        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.add_subplot()
        if not draw(ax, records):
            notes.append(f"{stem}.png: skipped, {path} has no {title.lower()} metrics")
            continue
        _finish(ax, f"{title} ({title_of})")
        _save(fig, out / f"{stem}.png")
        written.append(out / f"{stem}.png")
        drawn.append(stem)
    if drawn:
        fig = Figure(figsize=(15, 8), layout="constrained")
        fig.suptitle(f"{title_of}: {len(records)} records, steps {records[0]['step']}-{records[-1]['step']}")
        for i, stem in enumerate(drawn, 1):
            ax = fig.add_subplot(2, 3, i)
            title, draw = VIEWS[stem]
            draw(ax, records)
            _finish(ax, title)
        _save(fig, out / "overview.png")
        written.append(out / "overview.png")
    return written, notes


def _short(text: str, limit: int = 60) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."
