"""Actor (policy trainer) role: one Ray actor per Megatron rank, wrapping `MegatronTrainer`."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import ray

logger = logging.getLogger(__name__)


def trainer_settings(config: Any):
    from relax.backends.megatron.trainer import TrainerSettings

    return TrainerSettings(
        tp=config.tensor_model_parallel_size, pp=config.pipeline_model_parallel_size,
        cp=config.context_parallel_size, ep=config.expert_model_parallel_size,
        etp=config.expert_tensor_parallel_size, lr=config.lr, min_lr=config.min_lr or 0.0,
        lr_decay_style=config.lr_decay_style, lr_warmup_iters=config.lr_warmup_iters or 0,
        lr_decay_iters=config.lr_decay_iters, weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
        clip_grad=config.clip_grad, seed=config.seed, bf16=bool(config.bf16), fp16=bool(config.fp16),
        use_distributed_optimizer=bool(config.use_distributed_optimizer),
        micro_batch_size=config.micro_batch_size,
        logprob_chunk_size=None if config.log_probs_chunk_size in (None, -1) else config.log_probs_chunk_size,
    )


@ray.remote
class TrainerWorker:
    """One rank of the actor's Megatron group. All ranks are called together for collectives."""

    def __init__(self, config: Any, rank: int, world_size: int, threads: int = 1):
        import torch

        torch.set_num_threads(max(1, threads))
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.trainer = None
        self.data = None

    def master_address(self) -> tuple[str, int]:
        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            return host, sock.getsockname()[1]

    def setup(self, master_addr: str, master_port: int, backend: str) -> dict[str, Any]:
        from transformers import AutoConfig

        from relax.backends.megatron.arch import ModelArch
        from relax.backends.megatron.cpu_compat import apply_cpu_compat
        from relax.backends.megatron.parallel import init_distributed
        from relax.backends.megatron.trainer import MegatronTrainer
        from relax.data.plane import DataPlane

        apply_cpu_compat()
        init_distributed(self.rank, self.world_size, master_addr, master_port, backend=backend,
                         timeout_minutes=self.config.distributed_timeout_minutes)
        hf_config = AutoConfig.from_pretrained(self.config.hf_checkpoint)
        arch = ModelArch.from_hf_config(hf_config)
        self.trainer = MegatronTrainer(arch, trainer_settings(self.config))
        self.trainer.load_hf(self.config.hf_checkpoint)
        self.data = DataPlane.attach()
        return {"rank": self.rank, "dp": self.trainer.layout.dp, "params": sum(
            p.numel() for p in self.trainer.gpt_model.parameters())}

    def train(self, step: int, extras: dict[str, Any] | None = None) -> dict[str, float]:
        """Read step `step` from the data plane, compute advantages, and run the optimizer steps.

        `extras` holds per-sample inputs from auxiliary roles (see relax.core.roles), by sample order.
        """
        import torch

        from relax.training.advantages import sample_advantages, trainer_inputs
        from relax.training.objective import PolicyObjective

        t0 = time.perf_counter()
        samples = self.data.get(step)  # the whole step, in index order, on every rank
        if not samples:
            raise RuntimeError(f"step {step}: no samples in the data plane")
        advantages = sample_advantages(samples, self.config)
        inputs = trainer_inputs(samples, advantages)
        layout = self.trainer.layout
        gbs = self.config.global_batch_size or len(inputs)
        num_updates = max(1, len(inputs) // gbs)
        temperature = self.config.rollout_temperature
        if num_updates > 1 or self.config.use_rollout_logprobs:
            if self.config.use_rollout_logprobs:
                olds = [x["rollout_logprobs"] for x in inputs]
            else:
                olds = self.trainer.compute_logprobs(inputs, temperature)
            for x, old in zip(inputs, olds):
                x["old_logprobs"] = old
        objective = PolicyObjective.from_config(self.config)
        metrics: dict[str, list[float]] = {}
        for update in range(num_updates):
            batch = inputs[update * gbs:(update + 1) * gbs]
            mine = batch[layout.dp_rank::layout.dp]
            out = self.trainer.train_step(mine, objective, temperature)
            for key, value in out.items():
                if not torch.isfinite(torch.tensor(value)) and key in ("loss", "grad_norm"):
                    raise FloatingPointError(f"step {step}: train/{key} is {value}; the update was not applied")
                metrics.setdefault(key, []).append(value)
        result = {f"train/{k}": sum(v) / len(v) for k, v in metrics.items()}
        result["train/num_updates"] = float(num_updates)
        result["train/tokens"] = float(sum(len(x["tokens"]) for x in inputs))
        result["perf/train_compute_time"] = time.perf_counter() - t0
        return result

    def compute_logprobs(self, tokens: list[list[int]], response_lengths: list[int],
                         temperature: float = 1.0) -> list[list[float]]:
        import torch

        inputs = [{"tokens": torch.tensor(t, dtype=torch.long), "response_length": n}
                  for t, n in zip(tokens, response_lengths)]
        return [lp.tolist() for lp in self.trainer.compute_logprobs(inputs, temperature)]

    def push_weights(self, engine_urls: list[str], version: int, buffer_bytes: int) -> dict[str, Any]:
        """Every rank takes part in gathering; rank 0 sends the HF-named tensors to every engine."""
        from relax.weights.sync import push_named_tensors

        t0 = time.perf_counter()
        named = list(self.trainer.export_hf_weights())
        if self.rank != 0:
            return {}
        report = push_named_tensors(named, engine_urls, version, buffer_bytes)
        report["export_seconds"] = time.perf_counter() - t0 - report["seconds"]
        return report

    def save(self, path: str) -> str:
        return str(self.trainer.save_checkpoint(path))

    def load(self, path: str) -> int:
        return self.trainer.load_checkpoint(path)

    def weights_checksum(self) -> float:
        import torch

        with torch.no_grad():
            return float(sum(p.double().abs().sum() for p in self.trainer.gpt_model.parameters()))

    def shutdown(self) -> None:
        from relax.backends.megatron.parallel import destroy

        try:
            destroy()
        except Exception:  # best effort at exit
            pass
