"""Actor (policy trainer) role: one Ray actor per Megatron rank, wrapping `MegatronTrainer`."""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from relax.backends.megatron.arch import arch_for_run
from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings
from relax.config.support_gpu import GPU_ONLY_REASONS
from relax.data.plane import DataPlane
from relax.observability import timeline
from relax.observability.metrics_client import MetricsReporter
from relax.observability.profiling import Profiling, install_cuda_memory_check
from relax.roles.megatron_rank import MegatronRank
from relax.rollout.rewards.runner import check_step_rewards, reward_name
from relax.training.step import advantage_stage, check_rows, forward_stage, update_stage
from relax.weights.sync import push_for_config

logger = logging.getLogger(__name__)


def trainer_settings(config: Any, *, forward_only: bool = False):
    dynamic = bool(config.use_dynamic_batch_size)
    # Megatron: --recompute-activations is --recompute-granularity selective (checked in rules_recompute).
    granularity = config.recompute_granularity or ("selective" if config.recompute_activations else None)
    backend = getattr(config.attention_backend, "name", config.attention_backend)  # an enum from Megatron's parser
    return TrainerSettings(
        forward_only=forward_only,
        trainable_params=tuple(config.only_train_params_name_list or ()) if not forward_only else (),
        frozen_params=tuple(config.freeze_params_name_list or ()) if not forward_only else (),
        max_tokens_per_micro_batch=config.max_tokens_per_gpu if dynamic else None,
        logprob_max_tokens_per_micro_batch=config.log_probs_max_tokens_per_gpu if dynamic else None,
        tp=config.tensor_model_parallel_size, pp=config.pipeline_model_parallel_size,
        sequence_parallel=bool(config.sequence_parallel),
        cp=config.context_parallel_size, allgather_cp=bool(config.allgather_cp), ep=config.expert_model_parallel_size,
        etp=config.expert_tensor_parallel_size, lr=config.lr, min_lr=config.min_lr or 0.0,
        lr_decay_style=config.lr_decay_style, lr_warmup_iters=config.lr_warmup_iters or 0,
        lr_warmup_init=config.lr_warmup_init,
        lr_decay_iters=config.lr_decay_iters, weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
        optimizer=config.optimizer, sgd_momentum=config.sgd_momentum,
        gpu_features=tuple(name for name in GPU_ONLY_REASONS if config[name]),
        clip_grad=config.clip_grad, seed=config.seed, bf16=bool(config.bf16), fp16=bool(config.fp16),
        use_distributed_optimizer=bool(config.use_distributed_optimizer),
        micro_batch_size=config.micro_batch_size,
        logprob_chunk_size=None if config.log_probs_chunk_size in (None, -1) else config.log_probs_chunk_size,
        recompute_loss_function=bool(config.recompute_loss_function) and not forward_only,
        routing_replay=bool(config.use_routing_replay) and not forward_only,
        # Forward-only roles run without autograd: recompute has nothing to save there.
        recompute_granularity=None if forward_only else granularity,
        recompute_method=None if forward_only else config.recompute_method,
        recompute_num_layers=None if forward_only else config.recompute_num_layers,
        recompute_modules=None if forward_only or not config.recompute_modules else tuple(config.recompute_modules),
        # Relax's default is 0 (relax.config.megatron.RELAX_DEFAULT_OVERRIDES), Megatron's 0.1
        hidden_dropout=float(config.hidden_dropout), attention_dropout=float(config.attention_dropout),
        attention_backend=backend, moe_router_dtype=config.moe_router_dtype,
    )


@ray.remote
class TrainerWorker(MegatronRank):
    """One rank of the actor's Megatron group. All ranks are called together for collectives."""

    def __init__(self, config: Any, rank: int, world_size: int, threads: int = 1):
        super().__init__(config, rank, world_size, threads)
        self._batches: dict[int, Any] = {}  # step -> StepBatch, from the forward stage to the update
        # --use-pytorch-profiler sections and --memory-snapshot-num-steps records of this rank
        self.profiling = Profiling.from_config(config, rank)
        self.reporter = MetricsReporter.from_config(config)  # --use-metrics-service; a no-op otherwise

    def setup(self, master_addr: str, master_port: int, backend: str) -> dict[str, Any]:
        self.join_process_group(master_addr, master_port, backend)
        if self.config.enable_cuda_memory_check:  # before the model's collectives
            install_cuda_memory_check()
        # The --hf-checkpoint model (architecture flags given with it were checked to agree before the run), else
        # the model the architecture flags describe, randomly initialised until --ref-load or --load fills it.
        self.trainer = MegatronTrainer(arch_for_run(self.config), trainer_settings(self.config))
        if self.config.hf_checkpoint:
            self.trainer.load_hf(self.config.hf_checkpoint)
        if self.config.ref_load:  # the actor starts from the reference weights (--load, if any, comes later)
            self.trainer.load_weights(self.config.ref_load, self.config.ref_ckpt_step)
        if self.config.keep_old_actor:  # the engines start from these weights (see push_weights)
            self.trainer.keep_weights("old_actor")
        self.data = DataPlane.attach()
        return {"rank": self.rank, "dp": self.trainer.layout.dp, "where": self.where(), "params": sum(
            p.numel() for p in self.trainer.gpt_model.parameters())}

    # ------------------------------------------------------------------ the actor's stages of a step
    # Each reads its inputs from the step's partition and writes its per-sample outputs back as stage fields
    # (relax.data.sample.STAGE_FIELDS); relax.core.stages calls them in order. What stays on this rank from the
    # forward stage to the update is the step's `StepBatch` (relax.training.step).
    @timeline.traced("actor forward", cat="train")
    def forward(self, step: int) -> dict[str, float]:
        """Actor forward (every rank: the pass is collective): the old-policy log-probs of step `step`, written
        as `old_logprobs` (by rank 0; every rank computed all of them) when the loss needs them. A step whose
        every reward failed is not trained on (`relax.rollout.rewards.runner.check_step_rewards`)."""
        t0 = time.perf_counter()
        self.profiling.memory_begin()  # a training step runs from this stage to the update (`train`)
        self.profiling.start("train_overall", step)
        samples = self.data.get(step)  # the whole step, in index order, on every rank
        failed = check_step_rewards(samples, step, reward_name(self.config))
        with self.profiling.section("train_log_probs", step):
            batch, olds = forward_stage(self.trainer, samples, self.config, step)
        batch.metrics["train/reward_failed_samples"] = float(failed)
        if olds is not None and self.rank == 0:
            self.data.put_fields(step, [s.index for s in batch.samples], old_logprobs=olds)
        self._batches = {step: batch}  # a step's batch replaces the last one: one step in flight per rank
        return {"perf/old_logprob_time": time.perf_counter() - t0}

    @timeline.traced("actor advantages", cat="train")
    def advantages(self, step: int) -> dict[str, float]:
        """Advantages (rank 0 alone): from the rewards and the stage fields written so far (old, reference and
        teacher log-probs, critic values), written as `advantages` (and `returns` with ppo)."""
        t0 = time.perf_counter()
        batch = self._batch(step)
        inputs = [f for f in ("old_logprobs", "ref_logprobs", "values", "teacher_logprobs")
                  if f in self.data.written_fields(step)]
        rows = self._read_fields(batch, inputs)
        advantages, returns, _ = advantage_stage(batch, self.config, **rows)
        out = {"advantages": advantages} if returns is None else {"advantages": advantages, "returns": returns}
        self.data.put_fields(step, [s.index for s in batch.samples], **out)
        return {"perf/advantages_time": time.perf_counter() - t0}

    @timeline.traced("actor update", cat="train")
    def train(self, step: int) -> dict[str, float]:
        """The actor's update (every rank) from the step's advantages, old and reference log-probs."""
        batch = self._batches.pop(step, None) or self._batch(step)
        wanted = ["advantages"] + (["old_logprobs"] if batch.has_old_logprobs else [])
        if "ref_logprobs" in self.data.written_fields(step):
            wanted.append("ref_logprobs")
        rows = self._read_fields(batch, wanted)
        with self.profiling.section("train_actor", step):
            metrics = update_stage(self.trainer, batch, self.config, **rows)
        self.profiling.stop("train_overall", step)
        self.profiling.memory_end()
        self.reporter.report("trainer", self.rank, metrics, step=step)
        return metrics

    def _batch(self, step: int):
        batch = self._batches.get(step)
        if batch is None:
            raise RuntimeError(f"step {step}: the actor's forward stage has not run on rank {self.rank}")
        return batch

    def _read_fields(self, batch, names: list[str]) -> dict[str, Any]:
        """The step's stage fields `names` as float32 rows aligned with the batch's samples."""
        if not names:
            return {}
        stored = self.data.get(batch.step, fields=["index", *names])
        if [s.index for s in stored] != [s.index for s in batch.samples]:
            raise RuntimeError(f"step {batch.step}: the data plane holds other samples than the actor's batch")
        out = {}
        for name in names:
            rows = [getattr(s, name) for s in stored]
            check_rows(batch.samples, rows, name, batch.step)  # the rows follow the trained responses
            out[name] = [torch.tensor(r, dtype=torch.float32) for r in rows]
        return out

    def refresh_reference(self, step: int, targets: list[Any]) -> dict[str, float]:
        """--ref-update-interval: copy this rank's weights into its reference peer (after the step's update)."""
        t0 = time.perf_counter()
        deadline = self.config.train_step_timeout or None  # --train-step-timeout; 0: no deadline
        try:
            ray.get(targets[self.rank].set_model_state.remote(self.trainer.model_state()), timeout=deadline)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"reference rank {self.rank} did not take the refreshed weights within "
                               f"{deadline:g} s (--train-step-timeout)") from None
        return {"perf/ref_update_time": time.perf_counter() - t0}

    def compute_logprobs(self, tokens: list[list[int]], response_lengths: list[int],
                         temperature: float = 1.0) -> list[list[float]]:
        inputs = [{"tokens": torch.tensor(t, dtype=torch.long), "response_length": n}
                  for t, n in zip(tokens, response_lengths)]
        return [lp.tolist() for lp in self.trainer.compute_logprobs(inputs, temperature)]

    @timeline.traced("weight push", cat="weights")
    def push_weights(self, engine_urls: list[str], version: int, buffer_bytes: int) -> dict[str, Any]:
        """Every rank takes part in gathering; rank 0 sends the HF-named tensors to every engine (each request
        within --weight-update-timeout; past it a `WeightSyncError` names the engine)."""
        t0 = time.perf_counter()
        named = list(self.trainer.export_hf_weights())
        if self.config.keep_old_actor:  # the policy the engines roll out with until the next push
            self.trainer.keep_weights("old_actor")
        named = self._gather_pipeline_stages(named)
        if self.rank != 0:
            return {}
        if self.config.use_fault_tolerance or self.config.autoscaler_config:
            # A host copy of what the engines serve, for an engine that joins before the next push (a
            # replacement): push_kept_weights. It costs the model's size in host memory on rank 0.
            self._kept_push = (version, [(n, t.detach().to("cpu", copy=True)) for n, t in named])
        report = push_for_config(named, engine_urls, version, self.config)
        report["export_seconds"] = time.perf_counter() - t0 - report["seconds"]
        return report

    def push_kept_weights(self, engine_urls: list[str]) -> dict[str, Any] | None:
        """Rank 0 alone: push the weights of the last push (and its version) to `engine_urls`, the engines that
        join the pool (relax.rollout.engine_pool). None when nothing was pushed yet (the engines serve
        --hf-checkpoint, as a new one does). Needs no other rank, so it does not wait for a collective."""
        kept = getattr(self, "_kept_push", None)
        if kept is None:
            return None
        version, named = kept
        report = push_for_config(named, engine_urls, version, self.config)
        report["version"] = version
        return report

    def _gather_pipeline_stages(self, named: list) -> list:
        """With pipeline parallelism each stage exports only its own layers: rank 0 collects the other stages'
        tensors (its own pipeline group, on the host) so that the engines receive the whole model."""
        layout = self.trainer.layout
        if layout.pp == 1:
            return named
        if (layout.tp_rank, layout.cp_rank, layout.dp_rank) != (0, 0, 0):
            return named  # not in rank 0's pipeline: its copy of the weights is not sent
        group = ps.get_pipeline_model_parallel_group()
        mine = [(name, t.detach().cpu()) for name, t in named]
        stages = [None] * layout.pp if self.rank == 0 else None
        dist.gather_object(mine, stages, dst=0, group=group)
        if self.rank != 0:
            return []
        return [item for stage in stages for item in stage]

    def model_state(self) -> dict[str, Any]:
        return self.trainer.model_state()
