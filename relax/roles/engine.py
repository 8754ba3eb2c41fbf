"""Rollout engine role: one Ray actor per engine, owning the server process behind SGLang's HTTP API."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relax.wire.auth import ENGINE_API_KEY_ENV, ensure_engine_api_key
from relax.backends.embedded.launcher import EmbeddedServerProcess
from relax.backends.sglang.server import SGLangServerProcess
from relax.config.env import role_runtime_env, threads_per_process, worker_env

logger = logging.getLogger(__name__)


def engine_bind_host() -> str:
    """Where an engine listens: loopback while the whole Ray cluster is this one node (nothing else needs
    to reach it), the node's address only when roles span nodes. Either way its control endpoints need
    the run's key (relax.wire.auth)."""
    if not ray.is_initialized():
        return "127.0.0.1"
    alive = [node for node in ray.nodes() if node.get("Alive")]
    return ray.util.get_node_ip_address() if len(alive) > 1 else "127.0.0.1"


def engine_threads(config: Any) -> int:
    """torch threads of each embedded rollout engine: the node's cores less one, shared out among the engines."""
    return threads_per_process(config.num_engines)


def engine_server_args(config: Any, backend: str) -> dict[str, Any]:
    """The server options of the run's rollout engines of `backend`."""
    if backend == "embedded":
        args = {"dtype": "float32", "random_seed": config.rollout_seed,
                "num_threads": engine_threads(config),
                "max_running_requests": 256}
        if config.rollout_max_context_len:
            args["context_length"] = config.rollout_max_context_len
        if config.offload_rollout:  # released weights really free their storage
            args["offload_weights_on_release"] = True
        if config.sglang_disable_radix_cache:  # relax.config.support.EMBEDDED_SGLANG_FLAGS
            args["disable_radix_cache"] = True
        return args
    args = {k[len("sglang_"):]: v for k, v in config.items()
            if k.startswith("sglang_") and not k.startswith("sglang_router_") and v is not None}
    args.setdefault("random_seed", config.rollout_seed)
    if config.offload_rollout:  # /release_memory_occupation needs SGLang's memory saver
        args.setdefault("enable_memory_saver", True)
    if config.rollout_max_context_len:
        args.setdefault("context_length", config.rollout_max_context_len)
    if config.use_metrics_service:  # SGLang serves /metrics only with --enable-metrics
        args.setdefault("enable_metrics", True)
    return args


def lora_server_args(config: Any) -> dict[str, Any]:
    """SGLang's LoRA options for adapter-only sync (--lora-rank without --lora-merge-sync,
    relax.backends.megatron.lora_sync): LoRA enabled, its buffers sized for the run's rank and targets. The backend is
    SGLang's default on a GPU and torch_native on CPU (relax.backends.sglang.server.cpu_server_args);
    SGLang's own LoRA options given as --sglang-<option> flags win. Empty without adapter-only sync."""
    from relax.config.rules_arch import hf_arch
    from relax.config.rules_lora import adapter_sync, lora_targets
    from relax.formats.hf_names import lora_hf_modules

    if not adapter_sync(config):
        return {}
    # the HF names of the model's own projections (GLM4's gate_up_proj, no gate_proj without --swiglu)
    modules = lora_hf_modules(hf_arch(config), lora_targets(config))
    return {"enable_lora": True, "max_lora_rank": int(config.lora_rank), "max_loras_per_batch": 2,
            "lora_target_modules": modules}


def engine_actor(backend: str, model_path: str, server_args: dict[str, Any], gpus_per_engine: int,
                 log_dir: str, engine_id: int, placement: Any = None) -> Any:
    """Engine `engine_id`'s actor (its server not started yet), on `placement` = (placement group, bundle
    index) when given. The workers' environment and the run's engine key are handed on explicitly, as to every
    role, where the worker does not inherit them already: a Ray started elsewhere (or before this run) carries
    neither in its job environment (relax.config.env.role_runtime_env)."""
    env = {**worker_env(), ENGINE_API_KEY_ENV: ensure_engine_api_key()}
    options: dict[str, Any] = {"num_cpus": 1, "runtime_env": role_runtime_env(env)}
    if placement is not None and placement[0] is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement[0], placement_group_bundle_index=placement[1])
    return EngineActor.options(**options).remote(backend, model_path, server_args, gpus_per_engine, log_dir,
                                                 engine_id)


def rollout_engine_actor(config: Any, engine_id: int, placement: Any = None) -> Any:
    """One of the run's rollout engines (--hf-checkpoint on --rollout-backend, logs in the run's folder)."""
    args = engine_server_args(config, config.rollout_backend)
    if config.rollout_backend == "sglang":
        args = {**lora_server_args(config), **args}  # the --sglang-* flags win
    return engine_actor(config.rollout_backend, config.hf_checkpoint, args, config.rollout_num_gpus_per_engine,
                        os.path.join(config.output_dir, "logs"), engine_id, placement)


def launch_rollout_engines(config: Any, placement_group: Any) -> list[tuple[Any, Any]]:
    """The run's first rollout engines, one per bundle of `placement_group`, with their servers starting:
    (actor, ref of its `start`) each, for `RolloutManager.start_engines`. Begun by the controller as soon as
    the placement exists: an engine's start (a process that imports torch and transformers, then loads the
    model) no longer waits for the rollout manager's own imports, tokenizer and prompt data."""
    actors = [rollout_engine_actor(config, i, (placement_group, i)) for i in range(config.num_engines)]
    return [(actor, actor.start.remote()) for actor in actors]


PORT_TAKEN = "address already in use"
PORT_ATTEMPTS = 3


def start_with_port_retry(make, timeout_s: float):
    """Start the server `make()` builds and wait until it is healthy. Its port is found free before the
    server binds it, so another process can take it in between (seen on a busy machine: "[Errno 98] ...
    address already in use"); then a new server with a new port is tried, up to PORT_ATTEMPTS in all."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        process = make()
        process.start()
        try:
            return process.wait_healthy(timeout_s) or process
        except Exception as exc:
            process.stop()
            if attempt == PORT_ATTEMPTS or PORT_TAKEN not in str(exc).lower():
                raise
            logger.warning("engine port %d was taken before the server bound it; trying another", process.port)


@ray.remote
class EngineActor:
    """Starts an engine server in a child process and reports its URL; stops it on `shutdown`."""

    def __init__(self, backend: str, model_path: str, server_args: dict[str, Any], tp_size: int = 1,
                 log_dir: str | None = None, engine_id: int = 0):
        self.backend = backend
        self.model_path = model_path
        self.server_args = dict(server_args)
        self.tp_size = tp_size
        self.log_path = os.path.join(log_dir, f"engine-{engine_id}.log") if log_dir else None
        self.process = None

    def start(self, timeout_s: float = 300.0) -> str:
        host = engine_bind_host()
        if self.log_path:  # this node's copy of the run's log folder (engines may start before anything made it)
            os.makedirs(os.path.dirname(self.log_path), exist_ok=True)

        def make():
            if self.backend == "embedded":
                return EmbeddedServerProcess(self.model_path, host=host, server_args=self.server_args,
                                             log_path=self.log_path)
            return SGLangServerProcess(self.model_path, host=host, tp_size=self.tp_size,
                                       server_args=self.server_args, log_path=self.log_path)

        self.process = start_with_port_retry(make, timeout_s)
        return self.process.url

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def restart(self, timeout_s: float = 300.0) -> str:
        """A fresh server on this actor's devices (its placement bundle), from the model it was started with;
        the old one is killed first. Returns the new URL (a new port)."""
        self.kill_server()
        return self.start(timeout_s)

    def kill_server(self) -> None:
        """SIGKILL the server's process group at once: a hung (even SIGSTOPped) server dies, and the router's
        connections to it break, so the requests it held fail now and are sent again elsewhere."""
        if self.process is None:
            return
        if self.process.is_alive():
            self.process._signal_group(signal.SIGKILL)
        self.process.stop(timeout_s=5.0)
        self.process = None

    def signal_server(self, sig: int) -> None:
        """Send `sig` to the server's process group (test fault injection: SIGKILL, SIGSTOP)."""
        if self.process is not None and self.process.is_alive():
            self.process._signal_group(sig)

    def shutdown(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
