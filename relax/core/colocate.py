"""Taking turns on the same devices: --offload-train, --offload-rollout, and --colocate (which implies both).

The controller calls these hooks around its loop; each step runs (like slime and verl):

    rollout (engines hold their memory, trainer offloaded)
    before_train:   engines release memory (/release_memory_occupation); trainer ranks reload
    train
    before_sync:    engines resume "weights" only (/resume_memory_occupation); the KV cache stays released
    weight push     (the engines' weights are resident again and overwritten by the new ones)
    after_step:     trainer ranks offload; engines resume "kv_cache" (generation is possible again)

A step that pushes no weights (--update-weights-interval > 1) releases only the engines' KV cache, so their
weights are never dropped without a push to refill them. With --offload-train alone only the trainer side
moves; with --offload-rollout alone only the engines'. Each engine keeps an event log of these calls
(`memory_events` in GET /get_server_info) which tests use to check the order.

The engines' side goes through the rollout manager's engine pool (`release_engine_memory`,
`resume_engine_memory`), so it reaches the engines of the moment (a replaced or added engine too), and the
pool knows what is released (its health probes pause meanwhile; an engine that joins follows suit).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import ray


logger = logging.getLogger("relax")

WEIGHTS, KV_CACHE = "weights", "kv_cache"


class ColocateProtocol:
    def __init__(self, config: Any, workers: Sequence[Any], rollout: Any):
        """`rollout`: the rollout manager actor, whose engine pool the engines' calls go through (the engines of
        the moment); None, or --debug-train-only, when the run has no engines."""
        self.config = config
        self.workers = list(workers)
        self.rollout = rollout
        self.offload_train = bool(config.offload_train) and bool(self.workers) and not config.debug_rollout_only
        self.offload_rollout = (bool(config.offload_rollout) and rollout is not None and not config.debug_train_only
                                and not config.rollout_external)
        self.trainer_offloaded = False
        self.released: set[str] = set()

    @property
    def active(self) -> bool:
        return self.offload_train or self.offload_rollout

    # ------------------------------------------------------------------ the two sides
    def _offload_trainer(self) -> dict[str, float]:
        if not self.offload_train or self.trainer_offloaded:
            return {}
        t0 = time.perf_counter()
        reports = ray.get([w.offload_memory.remote() for w in self.workers])
        self.trainer_offloaded = True
        r = reports[0]
        return {"perf/offload_train_time": time.perf_counter() - t0,
                "offload/train_bytes": r.get("offload/bytes", 0.0),
                "offload/train_rss_before": r.get("offload/rss_before", 0.0),
                "offload/train_rss_after": r.get("offload/rss_after", 0.0)}

    def _reload_trainer(self) -> dict[str, float]:
        if not self.trainer_offloaded:
            return {}
        t0 = time.perf_counter()
        ray.get([w.reload_memory.remote() for w in self.workers])
        self.trainer_offloaded = False
        return {"perf/reload_train_time": time.perf_counter() - t0}

    def _release_engines(self, tags: list[str]) -> dict[str, float]:
        if not self.offload_rollout:
            return {}
        t0 = time.perf_counter()
        ray.get(self.rollout.release_engine_memory.remote(tags))
        self.released |= set(tags)
        return {"perf/engine_release_time": time.perf_counter() - t0}

    def _resume_engines(self, tags: list[str]) -> float:
        tags = [t for t in tags if t in self.released]
        if not tags:
            return 0.0
        t0 = time.perf_counter()
        ray.get(self.rollout.resume_engine_memory.remote(tags))
        self.released -= set(tags)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ hooks of the controller's loop
    def start(self) -> dict[str, float]:
        """After start-up (and any resume): the trainer makes room for the first rollout."""
        return self._offload_trainer()

    def before_train(self, step: int, will_sync: bool) -> dict[str, float]:
        metrics = self._release_engines([WEIGHTS, KV_CACHE] if will_sync else [KV_CACHE])
        metrics.update(self._reload_trainer())
        return metrics

    def before_sync(self, step: int) -> dict[str, float]:
        t = self._resume_engines([WEIGHTS])
        return {"perf/engine_resume_weights_time": t} if self.offload_rollout else {}

    def after_step(self, step: int) -> dict[str, float]:
        metrics = self._offload_trainer()
        metrics["perf/engine_resume_time"] = self._resume_engines([WEIGHTS, KV_CACHE])
        return metrics if self.active else {}

    def finish(self) -> None:
        """End of the loop: everything resident again (final checks, checkpoints, shutdown)."""
        try:
            self._reload_trainer()
            self._resume_engines([WEIGHTS, KV_CACHE])
        except Exception as exc:  # the loop may have failed already; do not hide its error
            logger.warning("colocate: could not reload after the loop: %s", exc)
