"""Rollout role: the manager actor that owns the engines, the router, the prompt source and rewards.

One call of `generate(step)` produces the step's samples and writes them into the step's data-plane
partition. The engines are the manager's `EnginePool` (relax.rollout.engine_pool), the run's only list of
them: the rollout, the controller's weight push (`push_targets`), colocation (`release_engine_memory`) and
fault tolerance (--use-fault-tolerance: `HealthMonitor`) read it; engines join (with the current weights)
and leave at run time (`add_engines`, `remove_engine`, `drain_engine`).

Step metrics: `step_metrics` always; `--log-passrate`, `--log-multi-turn`, `--log-correct-samples`
(which also writes OUTPUT_DIR/correct_samples/step_N.jsonl) and `--log-reward-category` add theirs
(`relax.rollout.step_logs`). With `--rollout-external` the engines are not started or stopped here:
the given addresses join the router, and shutdown stops only the router. With --genrm-model-path the manager
also starts the GenRM's own engines and router (`relax.roles.genrm`; never weight push targets) and
hands its judge to the rewards (reward type genrm); the step metrics add genrm/*.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from contextlib import nullcontext
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from tqdm import tqdm

from relax import heap
from relax.backends.relax_router.process import router_from_config
from relax.backends.sglang.router import RouterProcess
from relax.config.autoscaler import load_autoscaler_config
from relax.config.config import Config
from relax.config.rules_lora import ADAPTER_NAME, adapter_sync
from relax.roles.placement import cluster_has_gpus, create_placement_group, engine_bundle
from relax.data.plane import DataPlane
from relax.formats.replay_record import run_record
from relax.data.sample import Sample
from relax.observability.accounting import delivery_accounting
from relax.observability.autoscaler_status import DECISIONS_FILE
from relax.observability import timeline
from relax.observability.heartbeat import start_heartbeat
from relax.observability.metrics_client import MetricsReporter
from relax.rollout.autoscaler import Autoscaler
from relax.roles.engine import engine_bind_host, engine_server_args, engine_threads, rollout_engine_actor
from relax.rollout import generate as generation
from relax.rollout.buffer import build_data_source
from relax.rollout.context import RolloutContext, RolloutOutput, load_hook
from relax.rollout.debug_data import load_rollout_data, save_rollout_data
from relax.rollout.engine_pool import EnginePool, HealthMonitor, stop_engines
from relax.rollout.engine_watch import EngineWatcher
from relax.rollout.evaluation import eval_sets, evaluate, passrate_metrics
from relax.roles.genrm import GenRMService
from relax.rollout.fault_injection import EngineFault, arm, fault_from_env
from relax.rollout.prompts import PromptEncoder
from relax.rollout.rewards import RewardRunner
from relax.rollout.rewards.genrm import set_active_judge
from relax.wire.core_share import CORES_META, ROLLOUT_SLOT, CoreBoard
from relax.rollout.step_logs import group_variance_metrics, step_log_metrics

logger = logging.getLogger(__name__)


# Samples in flight per engine for SGLang servers without --sglang-max-running-requests: slime's default
# --sglang-server-concurrency (SGLang queues what it cannot run at once).
SGLANG_CONCURRENCY_PER_ENGINE = 512


def rollout_concurrency(config: Any, backend: str | None, num_engines: int) -> int:
    """How many samples the rollout keeps in flight: what each engine runs at once, times the engines."""
    if backend == "embedded":
        per_engine = engine_server_args(config, backend)["max_running_requests"]
    else:
        per_engine = config.sglang_max_running_requests or SGLANG_CONCURRENCY_PER_ENGINE
    return max(1, int(per_engine) * max(1, num_engines))


def _group(samples: list[Any]) -> list[list[Any]]:
    groups: dict[int, list[Any]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.values())


def step_metrics(samples: list[Any], gen_time: float) -> dict[str, float]:
    rewards = [float(s.reward) for s in samples]
    lengths = [len(s.response_tokens) for s in samples]
    return {
        "rollout/reward_mean": statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards),
        "rollout/response_len_mean": statistics.fmean(lengths),
        "rollout/truncated_fraction": sum(s.status == "truncated" for s in samples) / len(samples),
        "rollout/num_samples": float(len(samples)),
        "rollout/num_groups": float(len({s.group_index for s in samples})),
        "rollout/tokens": float(sum(lengths)),
        "rollout/loss_tokens": float(sum(sum(s.loss_mask) if s.loss_mask else len(s.response_tokens)
                                         for s in samples)),
        "perf/rollout_generate_time": gen_time,
        "perf/rollout_tokens_per_s": sum(lengths) / gen_time if gen_time > 0 else 0.0,
    }


def failover_window_s(config: Any) -> float:
    """How long a failed request is sent again (--use-fault-tolerance): until the health monitor has found the
    failed engine (first wait + one interval + one probe timeout), twice over, plus a margin."""
    return (float(config.rollout_health_check_first_wait) + 2 * (float(config.rollout_health_check_interval)
            + float(config.rollout_health_check_timeout)) + 30.0)


def pool_metrics(new: list[dict[str, Any]], history: list[dict[str, Any]]) -> dict[str, float]:
    """Step metrics of the pool's events since the last step (`new`; `history`: all of them): failures,
    replacements, additions, removals; the detection latency of a failure found this step (from its injected
    fault, when a test injected one) and the recovery time of a replacement finished this step (from the
    failure it replaced)."""
    metrics = {"engines/failed": float(sum(e["kind"] == "engine_failed" for e in new)),
               "engines/replaced": float(sum(e["kind"] == "engine_replaced" for e in new)),
               "engines/added": float(sum(e["kind"] == "engine_added" for e in new)),
               "engines/removed": float(sum(e["kind"] == "engine_removed" for e in new)),
               "engines/router_restarts": float(sum(e["kind"] == "router_restarted" for e in new))}
    injected = {e["url"]: e["time"] for e in history if e["kind"] == "fault_injected"}
    failed_at = {e["url"]: e["time"] for e in history if e["kind"] == "engine_failed"}
    for e in new:
        if e["kind"] == "engine_failed" and e["url"] in injected:
            metrics["engines/detect_s"] = e["time"] - injected[e["url"]]
        if e["kind"] == "engine_replaced" and e["old_url"] in failed_at:
            metrics["engines/recover_s"] = e["time"] - failed_at[e["old_url"]]
    return metrics


# Threaded: the controller's pool calls (push targets, memory release) and the health monitor's work go on
# while a step's generation runs; the pool is thread-safe.
@ray.remote(max_concurrency=8)
class RolloutManager:
    def __init__(self, config: Any):
        self.config = config
        # --use-health-check: beats from a thread of its own (relax.core.health), from the constructor on, so that
        # a killed or hung (stopped) manager is found by name and the run restarted as for a trainer rank
        self._heartbeat = start_heartbeat(self, role="rollout")
        from transformers import AutoTokenizer  # not at the top: the driver imports this module
        self.tokenizer = AutoTokenizer.from_pretrained(config.hf_checkpoint)
        self.encoder = PromptEncoder.from_args(config, self.tokenizer)
        # replaying saved rollouts needs no prompts
        self.source = None if config.load_debug_rollout_data else build_data_source(config, self.encoder)
        self.rewards = RewardRunner.from_args(config)
        self.rollout_fn = load_hook(config.rollout_function_path, "--rollout-function-path")
        self.postprocess = load_hook(config.rollout_data_postprocess_path, "--rollout-data-postprocess-path")
        self.log_fn = load_hook(config.custom_rollout_log_function_path, "--custom-rollout-log-function-path")
        self.eval_log_fn = load_hook(config.custom_eval_rollout_log_function_path,
                                     "--custom-eval-rollout-log-function-path")
        # The data plane is attached at the first put: the manager (and its engines) start while the
        # controller is still starting TransferQueue, which takes seconds on a small machine.
        self._data = None
        self.pool: EnginePool | None = None
        self.monitor: HealthMonitor | None = None
        self.watcher: EngineWatcher | None = None  # --engine-liveness-timeout (relax.rollout.engine_watch)
        self.autoscaler: Autoscaler | None = None  # --autoscaler-config (relax.rollout.autoscaler)
        self.router = None
        self.genrm: GenRMService | None = None  # --genrm-model-path: the judge's own engines and router
        self.backend: str | None = None  # the engines' backend; None for external engines
        self.next_index = 0
        self._chunks: dict[str, Any] | None = None  # the step being generated in chunks (`_generate_chunk`)
        self._events_seen = 0  # pool events already reported in a step's metrics
        # test-only (relax.rollout.fault_injection): faults armed for later steps, each fired once
        self.faults: list[EngineFault] = [f for f in [fault_from_env()] if f is not None]
        self.reporter = MetricsReporter.from_config(config)  # --use-metrics-service; a no-op otherwise
        timeline.set_role("rollout manager")
        heap.freeze()  # its tokenizer, prompts and reward functions live as long as the process (relax.heap)
        if config.use_fault_tolerance:
            generation.set_failover_window(failover_window_s(config))
        # --fully-async on CPU: the engines' cores are marked busy while they generate, so that the trainer
        # takes them only while they are idle (relax.wire.core_share)
        self.cores = None if config.rollout_external else CoreBoard.for_run(config.meta.get(CORES_META))
        self.engine_cores = engine_threads(config) * config.num_engines

    def _generating(self):
        return nullcontext() if self.cores is None else self.cores.computing(ROLLOUT_SLOT, self.engine_cores)

    def _data_plane(self) -> Any:
        if self._data is None:
            self._data = DataPlane.attach()
        return self._data

    # ------------------------------------------------------------------ engines and router
    def start_engines(self, placement_group=None, bundle_offset: int = 0, weight_source: Any = None,
                      launched: list[tuple[Any, Any]] | None = None) -> list[str]:
        """The router, then the run's engines in the pool (one per bundle of `placement_group` from
        `bundle_offset`). `weight_source`: trainer rank 0, which pushes the current weights to an engine that
        joins later (with --use-fault-tolerance it keeps them for that). `launched`: the engines' actors and
        the refs of their starts, when the controller began them (relax.roles.engine.launch_rollout_engines)."""
        c = self.config
        log_dir = os.path.join(c.output_dir, "logs")
        os.makedirs(log_dir, exist_ok=True)
        if c.rollout_external:
            count = len(c.rollout_external_engine_addrs)
        else:
            self.backend = c.rollout_backend  # `auto` is resolved (and checked) by config validation
            count = c.num_engines
        if c.use_slime_router:  # Relax's own router (relax.backends.relax_router)
            self.router = router_from_config(
                c, host=engine_bind_host(), log_path=os.path.join(log_dir, "router.log"),
                default_max_connections=rollout_concurrency(c, self.backend, count) + 8).start()
        else:
            self.router = RouterProcess(host="127.0.0.1", port=c.sglang_router_port,
                                        policy=c.sglang_router_policy or "round_robin",
                                        log_path=os.path.join(log_dir, "router.log")).start()
        self.pool = EnginePool(self.router, make_actor=None if c.rollout_external else self._make_engine_actor,
                               new_placement=self._new_placement, remove_placement=remove_placement_group,
                               control_timeout_s=c.engine_control_timeout,
                               sync_timeout_s=float(c.train_step_timeout or 3600.0))
        self.pool.weight_source = weight_source
        if c.rollout_external:
            urls = [a if a.startswith("http") else f"http://{a}" for a in c.rollout_external_engine_addrs]
            for url in urls:
                self.pool.adopt(url)
        else:
            placements = [(placement_group, bundle_offset + i) if placement_group is not None else None
                          for i in range(count)]
            urls = self.pool.start_initial(placements, launched=launched)
        for i, url in enumerate(urls):  # the metrics service scrapes each engine's /metrics in its own thread
            self.reporter.watch_engine("engine", i, url)
        if c.use_fault_tolerance and not c.rollout_external:
            self.monitor = HealthMonitor(self.pool, interval_s=c.rollout_health_check_interval,
                                         timeout_s=c.rollout_health_check_timeout,
                                         first_wait_s=c.rollout_health_check_first_wait).start()
        if c.engine_liveness_timeout > 0:  # after the monitor: a silent engine goes its way when it runs
            self.watcher = EngineWatcher(self.pool, c.engine_liveness_timeout).start()
        if c.autoscaler_config and not c.rollout_external:  # the file was validated before Ray
            cfg = load_autoscaler_config(c.autoscaler_config)
            if cfg.enabled:
                self.pool.stop_timeout_s = c.scale_in_shutdown_timeout
                self.autoscaler = Autoscaler(
                    cfg, self.pool, scale_out_timeout_s=c.scale_out_timeout,
                    partial_policy=c.scale_out_partial_success_policy, drain_timeout_s=c.scale_in_drain_timeout,
                    log_path=os.path.join(c.output_dir, DECISIONS_FILE),  # and autoscaler_status.json beside
                    # the metrics service's /autoscaler serves each status too (--use-metrics-service)
                    publish=(lambda status: self.reporter.publish("autoscaler", status))
                    if self.reporter.enabled else None).start()
        if c.genrm_model_path:  # never a push target: push_targets reads self.pool alone
            self.genrm = GenRMService(c)
            self.genrm.start()
            self.rewards.genrm = self.genrm.judge
            set_active_judge(self.genrm.judge)  # evaluation sets' reward runners judge with it too
        return urls

    def _make_engine_actor(self, engine_id: int, placement: Any) -> Any:
        return rollout_engine_actor(self.config, engine_id, placement)

    def _new_placement(self) -> Any:
        """Room for one engine beyond the run's first ones: a placement group of its own (one bundle)."""
        group = create_placement_group([engine_bundle(self.config, cluster_has_gpus())],
                                       f"relax-engine-{self.pool.next_id}")
        return (group, 0) if group is not None else None

    def set_weight_source(self, weight_source: Any) -> None:
        self.pool.weight_source = weight_source

    # The pool's operations, for the controller, tests and (later) an autoscaler.
    def add_engines(self, count: int = 1) -> list[str]:
        return self.pool.add(count)

    def add_engine(self, url: str) -> None:
        """An engine started elsewhere joins as it is (like --rollout-external)."""
        self.pool.adopt(url)

    def remove_engine(self, url: str) -> None:
        self.pool.remove(url, stop=False)

    def drain_engine(self, url: str, timeout_s: float = 30.0) -> bool:
        return self.pool.drain(url, timeout_s)

    def list_engines(self) -> list[dict[str, Any]]:
        return self.pool.list() if self.pool is not None else []

    def engine_events(self) -> list[dict[str, Any]]:
        return list(self.pool.events) if self.pool is not None else []

    def get_engine_urls(self) -> list[str]:
        return self.pool.urls() if self.pool is not None else []

    def push_targets(self) -> list[str]:
        """The engines the next weight push must reach (the controller asks before each push)."""
        return self.pool.push_targets() if self.pool is not None else []

    def weights_pushed(self, version: Any, urls: list[str]) -> None:
        self.pool.set_weight_version(version, urls)
        if adapter_sync(self.config) and str(version) != "0":
            # LoRA adapter-only sync: a push of version > 0 loaded the trainer's adapter on the engines (before it
            # they serve the base, which equals the adapter's B = 0 start); requests name it from now on
            generation.set_request_adapter(ADAPTER_NAME)

    def weight_version(self) -> str | None:
        return self.pool.weight_version if self.pool is not None else None

    def release_engine_memory(self, tags: list[str]) -> None:
        self.pool.release_memory(tags)

    def resume_engine_memory(self, tags: list[str]) -> None:
        self.pool.resume_memory(tags)

    def inject_engine_fault(self, spec: str) -> None:
        """Test-only: arm a fault (relax.rollout.fault_injection) for a later step; several may be armed (one
        run then tests several recoveries one after the other)."""
        self.faults.append(EngineFault.parse(spec))

    def _maybe_inject(self, step: int) -> None:
        if self.pool is None:
            return
        due = [f for f in self.faults if f.step == step]
        self.faults = [f for f in self.faults if f.step != step]
        for fault in due:
            self._inject(fault)

    def _inject(self, fault: EngineFault) -> None:
        engines = [e for e in self.pool.engines.values() if e.url]
        target = engines[fault.engine]
        if fault.router:  # the router's process group (the router and its parent watchdog)
            router = self.router
            arm(fault, target.url, lambda sig: os.killpg(router.proc.pid, sig),
                lambda info: self.pool.event("fault_injected", target="router", **{**info, "url": router.url}))
            return
        arm(fault, target.url, lambda sig: ray.get(target.actor.signal_server.remote(sig)),
            lambda info: self.pool.event("fault_injected", engine=target.id, **info))

    def router_url(self) -> str:
        return self.router.url

    def genrm_engine_urls(self) -> list[str]:
        return self.genrm.urls() if self.genrm is not None else []

    def genrm_router_url(self) -> str | None:
        return self.genrm.router.url if self.genrm is not None and self.genrm.router is not None else None

    # ------------------------------------------------------------------ one step
    def _context(self, progress: Any = None, config: Any = None) -> Any:
        urls = self.get_engine_urls()
        return RolloutContext(args=config if config is not None else self.config, tokenizer=self.tokenizer,
                              data_source=self.source, rewards=self.rewards,
                              router_url=self.router.url if self.router else None,
                              engine_urls=urls, progress=progress,
                              max_concurrency=rollout_concurrency(self.config, self.backend, len(urls)),
                              # SGLang gives every copy of an `n` request the same sampling seed (identical
                              # answers under deterministic sampling); the embedded engine gives copy j seed + j.
                              group_requests=self.backend == "embedded", batch_parts=max(1, len(urls)))

    @timeline.traced("generate and reward", cat="rollout")
    def generate(self, step: int, chunk: int = 0, chunks: int = 1) -> dict[str, Any]:
        """Produce step `step`'s samples (or replay saved ones) and write them into the data plane. Returns the
        step's metrics; with `chunks` > 1 (--num-iters-per-train-update) see `_generate_chunk`."""
        if chunks > 1:
            return self._generate_chunk(step, chunk, chunks)
        c = self.config
        t0 = time.perf_counter()
        extra: dict[str, float] = {}
        if c.load_debug_rollout_data:
            samples = load_rollout_data(c.load_debug_rollout_data, step, c.load_debug_rollout_data_subsample,
                                        seed=c.rollout_seed)
            if not samples:
                raise RuntimeError(f"--load-debug-rollout-data: step {step} holds no samples")
            groups = _group(samples)
        else:
            self._maybe_inject(step)
            resends = generation.FAILOVER_RESENDS
            with self._generating():
                groups, extra = self._rollout(step, c)
            if c.use_fault_tolerance:
                extra["rollout/failover_resends"] = float(generation.FAILOVER_RESENDS - resends)
            samples = self._index(step, groups)
        gen_time = time.perf_counter() - t0
        from_rollout = len(samples)
        if self.postprocess is not None:
            out = self.postprocess(c, samples)
            if out is not None:
                samples = list(out)
            for s in samples:
                s.validate()
            groups = _group(samples)
        if c.save_debug_rollout_data:
            save_rollout_data(c.save_debug_rollout_data, step, samples, run=run_record(c))
        self._put(step, samples)
        return self._step_metrics(step, samples, groups, gen_time, extra, from_rollout, t0)

    def _put(self, step: int, samples: list[Any]) -> None:
        t_put = time.perf_counter()
        self._data_plane().put(step, samples)
        self.reporter.report("data", "put", {"data/put_samples": float(len(samples)),
                                             "data/put_time": time.perf_counter() - t_put}, step=step)

    def _index(self, step: int, groups: list[list[Any]]) -> list[Any]:
        """The step's sample indexes, in group order, continuing the run's count."""
        samples = []
        for g in groups:
            for s in g:
                s.index = self.next_index
                s.rollout_step = step
                self.next_index += 1
                samples.append(s)
        return samples

    def _generate_chunk(self, step: int, chunk: int, chunks: int) -> dict[str, Any]:
        """Chunk `chunk` of `chunks` of step `step` (--num-iters-per-train-update, with --fully-async): the next
        --rollout-batch-size / chunks prompt groups of the data source, generated, rewarded, indexed (the run's
        count continues, so the step's indexes are those of an unchunked step) and stored in the step's
        partition at once, where the trainer reads them while the next chunk generates. Returns {"indexes":
        the chunk's sample indexes}; the last chunk's adds "metrics", the step's metrics over all its chunks
        (as an unchunked step's; the rollout function's own metrics, counts, summed over the chunks, so
        `rollout/sampling_rounds` counts at least one round per chunk).
        Config validation refuses what sees a whole step here (replayed rollouts, the post-process hook)."""
        c = self.config
        state = self._chunks
        if chunk == 0:
            self._maybe_inject(step)
            state = self._chunks = {"step": step, "next": 0, "t0": time.perf_counter(), "samples": [],
                                    "extra": {}, "resends": generation.FAILOVER_RESENDS}
        if state is None or (state["step"], state["next"]) != (step, chunk):
            raise RuntimeError(f"rollout chunk {chunk} of step {step} requested out of order")
        # the chunk's share of the step: its groups, drawn from the data source as many at a time (config
        # validation admits --over-sampling-batch-size only at the step's own batch, i.e. no over-sampling)
        size = c.rollout_batch_size // chunks
        part = Config({**c, "rollout_batch_size": size, "over_sampling_batch_size": size}, c.explicit, c.meta,
                      {**c.derived, "samples_per_step": c.samples_per_step // chunks})
        with self._generating():
            groups, extra = self._rollout(step, part)
        samples = self._index(step, groups)
        self._put(step, samples)
        state["samples"].extend(samples)
        for key, value in extra.items():
            state["extra"][key] = state["extra"].get(key, 0.0) + value
        state["next"] = chunk + 1
        out: dict[str, Any] = {"indexes": [s.index for s in samples]}
        if chunk + 1 < chunks:
            return out
        self._chunks = None
        extra = state["extra"]
        if c.use_fault_tolerance:
            extra["rollout/failover_resends"] = float(generation.FAILOVER_RESENDS - state["resends"])
        samples = state["samples"]
        gen_time = time.perf_counter() - state["t0"]
        if c.save_debug_rollout_data:
            save_rollout_data(c.save_debug_rollout_data, step, samples, run=run_record(c))
        out["metrics"] = self._step_metrics(step, samples, _group(samples), gen_time, extra, len(samples),
                                            state["t0"])
        return out

    def _step_metrics(self, step: int, samples: list[Any], groups: list[list[Any]], gen_time: float,
                      extra: dict[str, float], from_rollout: int, t0: float) -> dict[str, float]:
        c = self.config
        metrics = step_metrics(samples, gen_time)
        metrics.update(group_variance_metrics(samples))  # the collapse monitor reads the zero-variance fraction
        metrics.update(extra)
        if self.genrm is not None and self.genrm.judge is not None:  # genrm/latency_mean, genrm/parse_failures
            metrics.update(self.genrm.judge.take_metrics())
        metrics.update(delivery_accounting(kept=from_rollout, to_train=len(samples)))
        if c.load_debug_rollout_data:
            metrics["samples/replayed"] = float(from_rollout)
        if c.log_passrate:
            metrics.update(passrate_metrics(groups, "rollout/"))
        if c.log_multi_turn or c.log_correct_samples or c.log_reward_category:
            metrics.update(step_log_metrics(c, step, samples))
        if self.source is not None and hasattr(self.source, "stats"):
            stats = self.source.stats()
            for key in ("buffered_groups", "filtered_long_prompts", "bad_lines"):
                if key in stats:
                    metrics[f"rollout/{key}"] = float(stats[key])
        if self.log_fn is not None:
            metrics.update(self.log_fn(c, step, samples, dict(metrics)) or {})
        if self.pool is not None:
            history = list(self.pool.events)
            metrics.update(pool_metrics(history[self._events_seen:], history))
            self._events_seen = len(history)
            metrics["engines/active"] = float(len(self.pool.urls()))
        metrics["perf/rollout_total_time"] = time.perf_counter() - t0
        self.reporter.report("rollout", 0, metrics, step=step)
        return metrics

    def _rollout(self, step: int, c: Any) -> tuple[list[list[Any]], dict[str, float]]:
        """The rollout function's groups of step `step` under config `c` (the run's, or a chunk's with its
        --rollout-batch-size)."""
        if self.router is None:
            raise RuntimeError("rollout engines are not started (start_engines) and no "
                               "--load-debug-rollout-data was given")
        bar = tqdm(total=c.samples_per_step, desc=f"rollout {step}", leave=False,
                   mininterval=2.0, disable=not os.environ.get("RELAX_PROGRESS", "1") == "1")
        try:
            out = self._watched(lambda: self.rollout_fn(self._context(bar, c), step), f"rollout step {step}")
        finally:
            bar.close()
        groups, extra = (out.groups, dict(out.metrics)) if isinstance(out, RolloutOutput) else (out, {})
        groups = [g if isinstance(g, list) else [g] for g in groups]
        if len(groups) != c.rollout_batch_size:
            raise RuntimeError(f"--rollout-function-path {c.rollout_function_path} returned {len(groups)} prompt "
                               f"groups for step {step}; expected --rollout-batch-size {c.rollout_batch_size}")
        for g in groups:
            if not g or not all(isinstance(s, Sample) for s in g):
                raise TypeError(f"--rollout-function-path {c.rollout_function_path} must return non-empty lists "
                                "of Sample")
        return groups, extra

    def _watched(self, fn: Any, during: str) -> Any:
        """`fn()`, the engines watched while it runs (--engine-liveness-timeout; raises EngineUnresponsive)."""
        return self.watcher.run(fn, during) if self.watcher is not None else fn()

    def evaluate(self, step: int) -> dict[str, float]:
        """Metrics under `eval/<name>/...` for the configured evaluation sets."""
        c = self.config
        if self.router is None:
            raise RuntimeError("evaluation needs the rollout engines (not available with --debug-train-only)")
        t0 = time.perf_counter()
        metrics, data = self._watched(lambda: evaluate(self._context(), self.encoder, step, eval_sets(c)),
                                      f"evaluation at step {step}")
        if self.eval_log_fn is not None:
            metrics.update(self.eval_log_fn(c, step, data, dict(metrics)) or {})
        metrics["perf/eval_time"] = time.perf_counter() - t0
        return metrics

    # ------------------------------------------------------------------ checkpoints and shutdown
    def state_dict(self) -> dict[str, Any]:
        source = self.source.state_dict() if hasattr(self.source, "state_dict") else None
        return {"source": source, "next_index": self.next_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("source") is not None and hasattr(self.source, "load_state_dict"):
            self.source.load_state_dict(state["source"])
            if "next_group" in state and hasattr(self.source, "next_group"):  # older checkpoints
                self.source.next_group = state["next_group"]
        self.next_index = state["next_index"]

    def autoscaler_status(self) -> dict[str, Any] | None:
        """The engines with their last metrics, the last load sample, the scaling under way and every autoscaler
        decision with its reason: what OUTPUT_DIR/autoscaler_status.json holds (None: no autoscaler)."""
        return self.autoscaler.status() if self.autoscaler is not None else None

    def shutdown(self) -> None:
        if self.autoscaler is not None:  # no scaling while the pool stops
            self.autoscaler.stop(wait_s=min(8.0, float(self.config.engine_control_timeout)))
            self.autoscaler = None
        if self.watcher is not None:  # no engine is named while the engines stop
            self.watcher.stop()
            self.watcher = None
        # within the controller's grace for this call (relax.core.deadlines: at most 10 s)
        stop_engines(self.monitor, self.router, self.pool, min(8.0, float(self.config.engine_control_timeout)))
        self.monitor = self.router = None
        if self.genrm is not None:
            set_active_judge(None)
            self.genrm.shutdown()
            self.genrm = None
