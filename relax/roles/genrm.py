"""The GenRM engines (--genrm-model-path): a second `EnginePool` of the rollout manager, behind a router of its own.

`GenRMService.start()` reserves a placement group (one bundle per engine: --genrm-num-gpus-per-engine GPUs and a
CPU on GPU clusters, a CPU otherwise; --genrm-num-gpus / --genrm-num-gpus-per-engine engines, at least one),
starts an sglang-router and the engines on the run's rollout backend (SGLang on GPU, the embedded engine on
CPU, with the rollout engines' server options updated by --genrm-engine-config), each serving
--genrm-model-path. With --use-fault-tolerance a `HealthMonitor` probes and restarts them like the rollout
engines (a restarted GenRM engine reloads --genrm-model-path; the pool has no weight source and no version).

Never the policy's weights: the controller's weight push reaches `RolloutManager.push_targets`, which reads the
policy pool alone; this pool is not asked and keeps its weight version ("default") for the whole run.

Not released by colocation (--colocate / --offload-rollout): the GenRM engines run on a placement group of
their own, never on the trainer's devices, so releasing their memory would give the trainer nothing; and
releasing their weights would lose them (no push refills them), so they stay resident.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray.util.placement_group import remove_placement_group

from relax.backends.sglang.router import RouterProcess
from relax.roles.placement import cluster_has_gpus, create_placement_group
from relax.roles.engine import engine_actor, engine_server_args
from relax.rollout.engine_pool import EnginePool, HealthMonitor, stop_engines
from relax.config.genrm_options import engine_config
from relax.rollout.rewards.genrm import GenRMJudge

logger = logging.getLogger(__name__)


def genrm_num_engines(config: Any) -> int:
    return max(1, int(config.genrm_num_gpus) // int(config.genrm_num_gpus_per_engine))


class GenRMService:
    """Started by the rollout manager (`start`), stopped with it (`shutdown`). Its engines take the rollout
    engines' server options, with --genrm-engine-config's on top."""

    def __init__(self, config: Any):
        self.config = config
        self.backend = config.rollout_backend
        options, ignored = engine_config(config.genrm_engine_config, self.backend)
        if ignored:
            logger.warning("--genrm-engine-config %s: no effect with the embedded engine (SGLang sizing options)",
                           ", ".join(ignored))
        args = dict(engine_server_args(config, self.backend))
        args.pop("offload_weights_on_release", None)  # never released (see the module doc)
        args.update(options)
        self.server_args = args
        self.log_dir = os.path.join(config.output_dir, "logs", "genrm")
        self.router: Any = None
        self.pool: EnginePool | None = None
        self.monitor: HealthMonitor | None = None
        self.placement_group: Any = None
        self.judge: GenRMJudge | None = None

    def start(self) -> list[str]:
        c = self.config
        os.makedirs(self.log_dir, exist_ok=True)
        count = genrm_num_engines(c)
        use_gpu = cluster_has_gpus()
        bundle = {"GPU": float(c.genrm_num_gpus_per_engine), "CPU": 1.0} if use_gpu else {"CPU": 1.0}
        self.placement_group = create_placement_group([dict(bundle) for _ in range(count)], "relax-genrm")
        self.router = RouterProcess(host="127.0.0.1", policy="round_robin",
                                    log_path=os.path.join(self.log_dir, "router.log")).start()
        self.pool = EnginePool(self.router, make_actor=self._make_actor, control_timeout_s=c.engine_control_timeout,
                               sync_timeout_s=float(c.train_step_timeout or 3600.0))
        urls = self.pool.start_initial([(self.placement_group, i) for i in range(count)])
        if c.use_fault_tolerance:
            self.monitor = HealthMonitor(self.pool, interval_s=c.rollout_health_check_interval,
                                         timeout_s=c.rollout_health_check_timeout,
                                         first_wait_s=c.rollout_health_check_first_wait).start()
        from transformers import AutoTokenizer  # not at the top: the driver imports this module
        tokenizer = AutoTokenizer.from_pretrained(c.genrm_model_path)
        self.judge = GenRMJudge.from_args(c, self.router.url, tokenizer)
        logger.info("GenRM: %d engine(s) of %s behind %s", len(urls), c.genrm_model_path, self.router.url)
        return urls

    def _make_actor(self, engine_id: int, placement: Any) -> Any:
        return engine_actor(self.backend, self.config.genrm_model_path, self.server_args,
                            self.config.genrm_num_gpus_per_engine, self.log_dir, engine_id, placement)

    def urls(self) -> list[str]:
        return self.pool.urls() if self.pool is not None else []

    def list_engines(self) -> list[dict[str, Any]]:
        return self.pool.list() if self.pool is not None else []

    def shutdown(self) -> None:
        stop_engines(self.monitor, self.router, self.pool, min(8.0, float(self.config.engine_control_timeout)))
        self.monitor = self.router = self.pool = None
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:  # already gone with the cluster
                pass
            self.placement_group = None
