"""Critic role (`--advantage-estimator ppo`): one Ray actor per rank, in the actor's parallel layout, wrapping a
`MegatronTrainer` whose GPT model ends in a scalar value head (`relax.backends.megatron.model.ValueHead`).

Weights: the body from `--hf-checkpoint` with a fresh value head, then `--critic-load` if it names something
else than `--load` (a critic checkpoint dir, a save root holding `iter_XXXXXXX/critic`, or an HF folder: body
only). Resuming from `--load` restores the critic saved with that iteration (model, optimizer, scheduler).
Optimizer: its own Adam with `--critic-lr` (default `--lr`) and `--critic-lr-warmup-iters`; the other
optimizer and schedule flags are the actor's.

Stages of a step (relax.core.stages): `compute(step)` writes the values of this data-parallel rank's share of
the step's samples to the data plane (before the advantages); `train(step)` runs the clipped value-loss
updates (`relax.training.step.train_critic`) from the values and the GAE returns the advantage stage wrote.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray
import torch

from relax import heap
from relax.formats.model_arch import ModelArch
from relax.data.plane import DataPlane
from relax.observability import timeline
from relax.roles.megatron_rank import MegatronRank
from relax.roles.megatron_settings import trainer_settings
from relax.training.step import train_critic


def critic_settings(config: Any):
    base = trainer_settings(config)
    warmup = int(config.critic_lr_warmup_iters or 0)
    decay = base.lr_decay_iters
    if decay is not None and warmup >= decay:  # Megatron's scheduler needs decay steps beyond the warm-up
        decay = warmup + 1
    return dataclasses.replace(base, value_head=True, lr=float(config.critic_lr),  # --critic-lr defaults to --lr
                               lr_warmup_iters=warmup, lr_decay_iters=decay, trainable_params=(), frozen_params=())


@ray.remote
class CriticWorker(MegatronRank):
    """One rank of the critic group. All ranks are called together for collectives."""

    def __init__(self, config: Any, rank: int, world_size: int, threads: int = 1):
        super().__init__(config, rank, world_size, threads)

    def setup(self, master_addr: str, master_port: int, backend: str) -> dict[str, Any]:
        self.join_process_group(master_addr, master_port, backend)
        # not at the top: the driver imports this module for the actor class
        from transformers import AutoConfig
        from relax.backends.megatron.trainer import MegatronTrainer  # loads Megatron-core

        arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(self.config.hf_checkpoint))
        self.trainer = MegatronTrainer(arch, critic_settings(self.config))
        self.trainer.load_hf(self.config.hf_checkpoint)
        source = "hf body + fresh value head"
        load = self.config.critic_load
        if load and load != self.config.load:  # --load itself is restored by the controller's resume
            source = self.trainer.load_weights(load, role="critic") + f" {load}"
        self.data = DataPlane.attach()
        heap.freeze()  # the model and the optimizer live as long as the rank (relax.heap)
        return {"rank": self.rank, "dp": self.trainer.layout.dp, "source": source,
                "params": sum(p.numel() for p in self.trainer.gpt_model.parameters())}

    @timeline.traced("critic values", cat="train")
    def compute(self, step: int) -> dict[str, Any]:
        """Stage: the values of this data-parallel rank's share (samples[dp_rank::dp]) of step `step`, written to
        the data plane as `values`."""
        t0 = time.perf_counter()
        samples = self.data.get(step, fields=("index", "prompt_tokens", "response_tokens"))
        layout = self.trainer.layout
        mine = samples[layout.dp_rank::layout.dp]
        inputs = [{"tokens": torch.tensor(s.prompt_tokens + s.response_tokens, dtype=torch.long),
                   "response_length": len(s.response_tokens)} for s in mine]
        with self.computing("critic"):  # beside the actor's forward pass
            values = self.trainer.compute_values(inputs) if inputs else []
        self.data.put_fields(step, [s.index for s in mine], values=values)
        return {"samples": len(mine), "seconds": time.perf_counter() - t0}

    @timeline.traced("critic update", cat="train")
    def train(self, step: int) -> dict[str, float]:
        """Stage: the critic's update from the step's `values` and GAE `returns` (written by the advantage stage)."""
        samples = self.data.get(step, fields=("index", "prompt_tokens", "response_tokens", "loss_mask", "values",
                                              "returns"))
        return train_critic(self.trainer, samples, self.config, step)
