"""The embedded engine's `/metrics`: SGLang's Prometheus metric names (`sglang:*`, label `model_name`) for what
the embedded engine has, so that the metrics service and the autoscaler read both backends alike.

Exported: `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:num_used_tokens` and
`sglang:token_usage` (used KV positions over max running requests x context length: the embedded engine keeps
one KV cache per running request, so this is its share of the most it can hold) as gauges;
`sglang:prompt_tokens_total`, `sglang:cached_tokens_total` (prompt tokens of requests that shared another's
prefill row, `prefix.py`), `sglang:generation_tokens_total`, `sglang:num_requests_total` as counters
(cumulative since the server started, as Prometheus counters are: a reader's rate is the difference of its own
two reads over their time apart, so any number of readers see the same values); and `sglang:gen_throughput`, a
gauge like SGLang's (which the scheduler sets over its last logging interval): generated tokens per second over
the last THROUGHPUT_WINDOW_S or a little more, the same for every reader (a read changes none of the values).
SGLang's latency histograms (time to first token, queue time) are not measured by the embedded engine and not
exported.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

THROUGHPUT_WINDOW_S = 5.0


class EngineMetrics:
    def __init__(self, engine: Any, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.clock = clock
        self._lock = threading.Lock()
        # (time, generated tokens) at reads: the oldest kept is the newest at least THROUGHPUT_WINDOW_S old; the
        # first at construction when there is an engine (an app may be built without one, e.g. to test its
        # middleware), else at the first read
        self._history: deque[tuple[float, int]] = deque()
        if engine is not None:
            self._history.append((clock(), int(engine.stats.get("num_generated_tokens", 0))))

    def _throughput(self, generated: int) -> float:
        """Tokens/s since the newest reading at least THROUGHPUT_WINDOW_S old (or since the first one, early on):
        a window of time, not "since the previous read", so a second reader does not disturb the first."""
        now = self.clock()
        with self._lock:
            history = self._history
            if not history:
                history.append((now, generated))
            while len(history) > 1 and history[1][0] <= now - THROUGHPUT_WINDOW_S:
                history.popleft()
            then, before = history[0]
            if now > history[-1][0]:
                history.append((now, generated))
        return max(0, generated - before) / (now - then) if now > then else 0.0

    def text(self) -> str:
        e = self.engine
        stats = e.stats
        label = '{model_name="%s"}' % str(e.served_model_name).replace("\\", "\\\\").replace('"', '\\"')
        used = e.num_tokens_in_use()
        capacity = max(1, e.max_running_requests * e.context_length)
        generated = int(stats.get("num_generated_tokens", 0))
        rows = [
            ("sglang:num_running_reqs", "gauge", "Requests in the running batch.", e.num_running()),
            ("sglang:num_queue_reqs", "gauge", "Requests waiting to join the running batch.", e.num_waiting()),
            ("sglang:num_used_tokens", "gauge", "KV positions held by running requests.", used),
            ("sglang:token_usage", "gauge", "Used KV positions over max running requests x context length.",
             used / capacity),
            ("sglang:gen_throughput", "gauge", f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:g} s.",
             self._throughput(generated)),
            ("sglang:prompt_tokens_total", "counter", "Prompt tokens of requests (cached ones included).",
             stats.get("num_prompt_tokens", 0)),
            ("sglang:cached_tokens_total", "counter", "Prompt tokens reused from another request's prefill.",
             stats.get("num_cached_tokens", 0)),
            ("sglang:generation_tokens_total", "counter", "Tokens generated.", generated),
            ("sglang:num_requests_total", "counter", "Requests finished.", stats.get("num_requests_finished", 0)),
        ]
        lines = []
        for name, kind, doc, value in rows:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{label} {float(value)!r}"]
        return "\n".join(lines) + "\n"
