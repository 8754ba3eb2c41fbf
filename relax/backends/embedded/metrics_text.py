"""The embedded engine's `/metrics`: SGLang's Prometheus metric names (`sglang:*`, label `model_name`) for what
the embedded engine has, so that the metrics service and the autoscaler read both backends alike.

Exported: `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:num_used_tokens` and
`sglang:token_usage` (used KV positions over max running requests x context length: the embedded engine keeps
one KV cache per running request, so this is its share of the most it can hold) as gauges;
`sglang:prompt_tokens_total`, `sglang:cached_tokens_total` (prompt tokens of requests that shared another's
prefill row, `prefix.py`), `sglang:generation_tokens_total`, `sglang:num_requests_total` as counters; and
`sglang:gen_throughput`, generated tokens per second since the previous scrape. SGLang's latency histograms
(time to first token, queue time) are not measured by the embedded engine and not exported.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class EngineMetrics:
    def __init__(self, engine: Any):
        self.engine = engine
        self._lock = threading.Lock()
        self._last = (time.monotonic(), 0)

    def _throughput(self, generated: int) -> float:
        now = time.monotonic()
        with self._lock:
            then, before = self._last
            self._last = (now, generated)
        return (generated - before) / (now - then) if now > then else 0.0

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
            ("sglang:gen_throughput", "gauge", "Generated tokens per second since the previous scrape.",
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
