"""Rollout role: the manager actor that owns the engines, the router, the prompt source and rewards.

One call of `generate(step)` produces the step's samples and writes them into the step's data-plane
partition. Engines join and leave the router at run time (`add_engine` / `remove_engine`), so an
autoscaler or a health manager can change the set without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from typing import Any

import ray

logger = logging.getLogger(__name__)


def engine_server_args(config: Any, backend: str) -> dict[str, Any]:
    if backend == "embedded":
        args = {"dtype": "float32", "random_seed": config.rollout_seed, "num_threads": max(1, (os.cpu_count() or 2)),
                "max_running_requests": 256}
        if config.rollout_max_context_len:
            args["context_length"] = config.rollout_max_context_len
        return args
    args = {k[len("sglang_"):]: v for k, v in config.items()
            if k.startswith("sglang_") and not k.startswith("sglang_router_") and v is not None}
    args.setdefault("random_seed", config.rollout_seed)
    if config.rollout_max_context_len:
        args.setdefault("context_length", config.rollout_max_context_len)
    return args


@ray.remote
class RolloutManager:
    def __init__(self, config: Any):
        from transformers import AutoTokenizer

        from relax.data.plane import DataPlane
        from relax.rollout.data_source import PromptDataSource
        from relax.rollout.prompts import PromptEncoder
        from relax.rollout.rewards import RewardRunner

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.hf_checkpoint)
        self.encoder = PromptEncoder.from_args(config, self.tokenizer)
        self.source = PromptDataSource.from_args(config, prompt_encoder=self.encoder)
        self.rewards = RewardRunner.from_args(config)
        self.data = DataPlane.attach()
        self.engines: list[Any] = []
        self.engine_urls: list[str] = []
        self.router = None
        self.next_index = 0
        self.next_group = 0

    # ------------------------------------------------------------------ engines and router
    def start_engines(self, placement_group=None, bundle_offset: int = 0) -> list[str]:
        from relax.backends.sglang.router import RouterProcess
        from relax.roles.engine import EngineActor, resolve_backend

        c = self.config
        log_dir = os.path.join(c.output_dir, "logs")
        os.makedirs(log_dir, exist_ok=True)
        if c.rollout_external:
            urls = [a if a.startswith("http") else f"http://{a}" for a in c.rollout_external_engine_addrs]
        else:
            backend = resolve_backend(c.rollout_backend)
            gpus = c.resource["rollout"][0] * c.resource["rollout"][1]
            num_engines = max(1, gpus // c.rollout_num_gpus_per_engine)
            args = engine_server_args(c, backend)
            options: dict[str, Any] = {"num_cpus": 1}
            for i in range(num_engines):
                if placement_group is not None:
                    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                        placement_group=placement_group, placement_group_bundle_index=bundle_offset + i)
                self.engines.append(EngineActor.options(**options).remote(
                    backend, c.hf_checkpoint, args, c.rollout_num_gpus_per_engine, log_dir, i))
            urls = ray.get([e.start.remote() for e in self.engines])
        self.router = RouterProcess(host="127.0.0.1", port=c.sglang_router_port,
                                    policy=c.sglang_router_policy or "round_robin",
                                    log_path=os.path.join(log_dir, "router.log")).start()
        for url in urls:
            self.add_engine(url)
        return urls

    def add_engine(self, url: str) -> None:
        self.router.add_worker(url)
        self.engine_urls.append(url)

    def remove_engine(self, url: str) -> None:
        self.router.remove_worker(url)
        self.engine_urls.remove(url)

    def get_engine_urls(self) -> list[str]:
        return list(self.engine_urls)

    def router_url(self) -> str:
        return self.router.url

    # ------------------------------------------------------------------ one step
    def generate(self, step: int) -> dict[str, float]:
        from tqdm import tqdm

        from relax.data.sample import Sample
        from relax.rollout.generate import SamplingSettings, generate_samples

        c = self.config
        t0 = time.perf_counter()
        n = c.n_samples_per_prompt
        samples: list[Sample] = []
        while len(samples) < c.rollout_batch_size * n:
            for record in self.source.get_batch(c.rollout_batch_size - len(samples) // n):
                tokens = self.encoder.encode_or_none(record.prompt)
                if tokens is None:
                    continue  # counted by the encoder as a filtered long prompt
                group = self.next_group
                self.next_group += 1
                for _ in range(n):
                    samples.append(Sample(index=self.next_index, group_index=group, prompt=record.prompt,
                                          prompt_tokens=tokens, label=record.label, metadata=dict(record.metadata),
                                          rollout_step=step))
                    self.next_index += 1
        bar = tqdm(total=len(samples), desc=f"rollout {step}", leave=False, mininterval=2.0,
                   disable=not os.environ.get("RELAX_PROGRESS", "1") == "1")
        samples = asyncio.run(generate_samples(self.router.url, samples, SamplingSettings.from_config(c),
                                               progress=bar))
        bar.close()
        gen_time = time.perf_counter() - t0
        result = self.rewards.score(samples, group_size=n, assign=True)
        self.data.put(step, samples)
        rewards = [s.reward for s in samples]
        lengths = [len(s.response_tokens) for s in samples]
        total = time.perf_counter() - t0
        return {
            "rollout/reward_mean": statistics.fmean(rewards),
            "rollout/reward_std": statistics.pstdev(rewards),
            "rollout/response_len_mean": statistics.fmean(lengths),
            "rollout/truncated_fraction": sum(s.status == "truncated" for s in samples) / len(samples),
            "rollout/reward_errors": float(result.num_errors),
            "rollout/num_samples": float(len(samples)),
            "rollout/tokens": float(sum(lengths)),
            "perf/rollout_generate_time": gen_time,
            "perf/rollout_tokens_per_s": sum(lengths) / gen_time if gen_time > 0 else 0.0,
        }

    def evaluate(self, step: int) -> dict[str, float]:
        """Metrics under `eval/<name>/...` for the configured evaluation sets."""
        raise NotImplementedError("evaluation (--eval-interval with --eval-prompt-data/--eval-config) is not built yet")

    # ------------------------------------------------------------------ checkpoints and shutdown
    def state_dict(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(), "next_index": self.next_index, "next_group": self.next_group}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state["source"])
        self.next_index, self.next_group = state["next_index"], state["next_group"]

    def shutdown(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        for engine in self.engines:
            try:
                ray.get(engine.shutdown.remote(), timeout=30)
            except Exception:  # the engine actor may already be gone
                pass
        self.engines = []
