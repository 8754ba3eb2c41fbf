"""Timeline of a run (--timeline-dump-dir): spans of every role, merged into one Chrome-trace JSON.

Each process appends its finished spans, one JSON line each, to `<dir>/spans/<host>-<pid>.jsonl` (no Ray call,
no shared state: a role that dies keeps what it wrote). `merge(dir)` turns all of them into
`<dir>/timeline.json` in the Chrome trace-event format (complete "X" events, microseconds, one track per
process and thread, named by role), which Perfetto (ui.perfetto.dev) and chrome://tracing load. The controller
merges after every step, so a run that is stopped still leaves a timeline of its finished steps.

Work that overlaps on one thread (the rollout manager scores each prompt group's rewards as an asyncio task)
goes on lanes (`lane_span`): each span takes the first lane of its kind that is free ("reward 0", "reward 1",
...), a track of its own, so that the spans of one track never overlap, as Perfetto expects of a track.

Where the directory comes from: the controller sets `TIMELINE_ENV` in its own environment and in every role's
(`relax.config.env.worker_env`), so engine servers started by roles inherit it. Timestamps are each host's
wall clock (`time.time()`): spans of one node line up exactly, spans of several nodes as well as their clocks
agree.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from relax.config.env import TIMELINE_ENV
TRACE_NAME = "timeline.json"

_lock = threading.Lock()
_state: dict[str, Any] = {"role": None, "file": None, "path": None}
_lanes_lock = threading.Lock()
_lanes_busy: dict[str, set[int]] = {}  # kind -> numbers of its lanes that hold an open span


def set_role(role: str) -> None:
    """Name this process's track (e.g. "trainer rank 0", "engine 1"); the process id names it otherwise."""
    _state["role"] = role


def enabled() -> bool:
    return bool(os.environ.get(TIMELINE_ENV))


def _spans_file():
    directory = os.environ.get(TIMELINE_ENV)
    path = Path(directory) / "spans" / f"{socket.gethostname()}-{os.getpid()}.jsonl"
    if _state["path"] != path:  # first span of this process, or the directory changed (tests)
        path.parent.mkdir(parents=True, exist_ok=True)
        _state["file"] = open(path, "a", buffering=1)  # line-buffered: each span reaches the disk whole
        _state["path"] = path
    return _state["file"]


def record(name: str, start_s: float, end_s: float, *, step: int | None = None, cat: str = "stage",
           lane: str | None = None, **args: Any) -> None:
    """Write one finished span (wall-clock seconds); a no-op without --timeline-dump-dir. `lane`: the track
    within the process (see `lane_span`); the calling thread's otherwise."""
    if not enabled():
        return
    if step is not None:
        args["step"] = step
    tid = zlib.crc32(lane.encode()) % 2**31 if lane else threading.get_ident() % 2**31
    event = {"name": name, "cat": cat, "ts": start_s * 1e6, "dur": max(0.0, end_s - start_s) * 1e6,
             "pid": os.getpid(), "tid": tid, "host": socket.gethostname(),
             "role": _state["role"] or f"process {os.getpid()}",
             "thread": lane or threading.current_thread().name, "args": args}
    line = json.dumps(event) + "\n"
    with _lock:
        _spans_file().write(line)


@contextmanager
def span(name: str, *, step: int | None = None, cat: str = "stage", **args: Any) -> Iterator[None]:
    """Record the block as a span named `name` (also when it raises: the span then carries the error)."""
    if not enabled():
        yield
        return
    start = time.time()
    try:
        yield
    except BaseException as exc:
        args["error"] = type(exc).__name__
        raise
    finally:
        record(name, start, time.time(), step=step, cat=cat, **args)


@contextmanager
def lane_span(name: str, kind: str, *, step: int | None = None, cat: str = "stage",
              **args: Any) -> Iterator[dict[str, Any]]:
    """`span` for work that overlaps others of its `kind` on one thread (asyncio tasks): the span goes on the
    first lane "<kind> <n>" that holds no open span. Yields the span's args, which the block may add to (a
    count known at the end)."""
    if not enabled():
        yield args
        return
    with _lanes_lock:
        busy = _lanes_busy.setdefault(kind, set())
        number = next(n for n in range(len(busy) + 1) if n not in busy)
        busy.add(number)
    start = time.time()
    try:
        yield args
    except BaseException as exc:
        args["error"] = type(exc).__name__
        raise
    finally:
        end = time.time()
        with _lanes_lock:
            _lanes_busy[kind].discard(number)
        record(name, start, end, step=step, cat=cat, lane=f"{kind} {number}", **args)


def traced(name: str, cat: str = "stage") -> Callable:
    """Decorate a role method whose first argument is the step: each call is a span of this process."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(self: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
            with span(name, step=step if isinstance(step, int) else None, cat=cat):
                return method(self, step, *args, **kwargs)

        return call

    return wrap


def read_spans(directory: str | Path) -> list[dict[str, Any]]:
    """Every span written under `directory` (a line cut short by a killed process is skipped)."""
    spans = []
    for path in sorted((Path(directory) / "spans").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return spans


def chrome_trace(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """The Chrome trace-event document of `spans`: one process track per (host, pid), named by its role."""
    events: list[dict[str, Any]] = []
    named: set[tuple] = set()
    pids: dict[tuple, int] = {}
    for s in sorted(spans, key=lambda s: s["ts"]):
        key = (s["host"], s["pid"])
        pid = pids.setdefault(key, len(pids) + 1)  # pids of several hosts may collide: number the tracks
        if key not in named:
            named.add(key)
            events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                           "args": {"name": f"{s['role']} ({s['host']} pid {s['pid']})"}})
        if (key, s["tid"]) not in named:
            named.add((key, s["tid"]))
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": s["tid"],
                           "args": {"name": s["thread"]}})
        events.append({"name": s["name"], "cat": s["cat"], "ph": "X", "ts": s["ts"], "dur": s["dur"],
                       "pid": pid, "tid": s["tid"], "args": s["args"]})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def merge(directory: str | Path) -> Path:
    """Write `<directory>/timeline.json` from every span so far (atomically: a reader never sees half)."""
    out = Path(directory) / TRACE_NAME
    out.parent.mkdir(parents=True, exist_ok=True)  # a run that failed before any span still gets a (empty) trace
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(chrome_trace(read_spans(directory))))
    os.replace(tmp, out)
    return out
