"""Actor (policy trainer) role: one Ray actor per Megatron rank, wrapping `MegatronTrainer`."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import ray
import torch
import torch.distributed as dist

from relax import heap
from relax.formats.model_arch import arch_for_run
from relax.backends.megatron.cpu_compat import native_device_ops
from relax.backends.megatron.hf_weights import unwrap_model
from relax.backends.megatron.lora import load_adapters
from relax.backends.megatron.lora_sync import push_for_config as push_adapter_for_config
from relax.backends.megatron.optim import gather_params
from relax.config.facts import REFERENCE_IN_RANK, needs_reference
from relax.config.rules_lora import adapter_sync
from relax.data.plane import DataPlane
from relax.data.sample import ROLLOUT_FIELDS, Sample
from relax.observability import timeline
from relax.observability.metrics_client import MetricsReporter
from relax.observability.profiling import Profiling, install_cuda_memory_check
from relax.roles.megatron_rank import MegatronRank
from relax.roles.megatron_settings import build_reference_trainer, trainer_settings
from relax.roles.reference_process import POLICY, REFERENCE
from relax.roles.reference_source import InRankReference, ReferenceSource, reference_for_rank
from relax.roles.step_passes import StepPasses
from relax.rollout.rewards.runner import check_step_rewards, reward_name
from relax.training.step import advantage_stage, check_rows, forward_stage, update_stage
from relax.training.streaming import StreamingUpdate
from relax.weights.sync import push_for_config
from relax.wire.core_share import ElasticThreads, node_cores

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _random_state_kept():
    """Building a second model in a rank re-seeds and draws (relax.backends.megatron.parallel.seed_all, random
    init before the weights load): the actor's random streams continue afterwards as if it had not happened."""
    import random

    import numpy as np

    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


@ray.remote
class TrainerWorker(MegatronRank):
    """One rank of the actor's Megatron group. All ranks are called together for collectives."""

    def __init__(self, config: Any, rank: int, world_size: int, threads: int = 1):
        super().__init__(config, rank, world_size, threads)
        self._batches: dict[int, Any] = {}  # step -> StepBatch, from the forward stage to the update
        # Rows of the step's stage fields this rank computed itself (all of them, or its data-parallel share
        # when dp is 1): later stages of the same step take them from here instead of reading them back from
        # the data plane. One step at a time, like `_batches`. When this rank holds every field it reads
        # (`_holds_every_field`: no critic, teacher or reference of its own role) no other role reads them
        # either, and the step's partition is cleared after the update: the rows are then not written to the
        # data plane at all (three writes of 512 rows a step on the embedded default).
        self._rows: dict[int, dict[str, list[torch.Tensor]]] = {}
        # the step's samples read by the in-trainer reference stage, for the forward stage that follows
        self._prefetched: dict[int, list[Sample]] = {}
        # the reference rows when the reference runs in this rank (config.reference_placement, relax.config.facts;
        # relax.roles.reference_source): the one rank's child process starts now, so that its imports and model
        # build overlap this rank's start-up; an in-rank model is built in `setup`, in the ranks' groups. The
        # backend (Megatron-core) is imported first, in this process (the driver imports this module for the actor
        # class alone: relax.roles.megatron_rank), so that a forked child has it already (relax.roles.forked_child).
        import relax.backends.megatron.trainer  # noqa: F401

        # The model's architecture, read before the fork too: reading an HF config imports transformers (~1.5 CPU s),
        # which the child then has instead of importing it again for its own models.
        self.arch = arch_for_run(config)
        self.reference: ReferenceSource | None = reference_for_rank(config, torch.get_num_threads())
        self._streaming: dict[str, Any] | None = None  # the step trained in chunks (`train_chunk`)
        # --use-pytorch-profiler sections and --memory-snapshot-num-steps records of this rank
        self.profiling = Profiling.from_config(config, rank)
        self.reporter = MetricsReporter.from_config(config)  # --use-metrics-service; a no-op otherwise
        self.elastic: ElasticThreads | None = None  # set in `setup` when the run shares idle cores

    def setup(self, master_addr: str, master_port: int, backend: str) -> dict[str, Any]:
        self.join_process_group(master_addr, master_port, backend)
        if self.config.enable_cuda_memory_check:  # before the model's collectives
            install_cuda_memory_check()
        # The --hf-checkpoint model (architecture flags given with it were checked to agree before the run), else
        # the model the architecture flags describe, randomly initialised until --ref-load or --load fills it.
        from relax.backends.megatron.trainer import MegatronTrainer  # not at the top: see relax.roles.megatron_rank

        self.trainer = MegatronTrainer(self.arch, trainer_settings(self.config))
        if self.config.hf_checkpoint:
            self.trainer.load_hf(self.config.hf_checkpoint)
        if self.config.ref_load:  # the actor starts from the reference weights (--load, if any, comes later)
            self.trainer.load_weights(self.config.ref_load, self.config.ref_ckpt_step)
        if self.config.lora_load:  # the adapters to start from, on that base (relax.backends.megatron.lora)
            load_adapters(self.trainer, self.config.lora_load)
        if self.config.keep_old_actor:  # the engines start from these weights (see push_weights)
            self.trainer.keep_weights("old_actor")
        if self.config.reference_placement == REFERENCE_IN_RANK:  # sharing the actor's model-parallel groups
            with _random_state_kept():
                self.reference = InRankReference(build_reference_trainer(self.config)[0])
        if self.core_board is not None:  # --fully-async on CPU: the cores the rollout leaves idle
            self.elastic = ElasticThreads(self.core_board, self.threads, node_cores() // self.world_size,
                                          torch.set_num_threads)
            from relax.backends.megatron.layer_hooks import at_every_layer

            at_every_layer(self.trainer.model, self.elastic.apply)
        heap.freeze()  # the models and the optimizer live as long as the rank (relax.heap)
        return {"rank": self.rank, "dp": self.trainer.layout.dp, "where": self.where(), "params": sum(
            p.numel() for p in self.trainer.gpt_model.parameters())}

    def attach_data_plane(self) -> None:
        """Connect to the run's data plane. Called after `setup`, once the controller has started the data plane:
        the model builds while the data plane's processes start."""
        self.data = DataPlane.attach()

    def _elastic_begin(self) -> None:
        """A step's first stage: its mean thread count (reported with the update) starts here."""
        if self.elastic is not None:
            self.elastic.reset()
            self.elastic.apply()

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
        self._elastic_begin()
        self.profiling.memory_begin()  # a training step runs from this stage to the update (`train`)
        self.profiling.start("train_overall", step)
        samples = self._prefetched.pop(step, None)  # read by this rank's reference stage just before
        if samples is None:
            samples = self.data.get(step)  # the whole step, in index order, on every rank
        passes = self._step_passes(step)
        if passes is not None:
            passes.actor_start = t0
        # with old-policy rows streamed this rank computes none (relax.roles.step_passes)
        streamed_old = passes is not None and passes.streams_old
        try:
            failed = check_step_rewards(samples, step, reward_name(self.config))
            with self.profiling.section("train_log_probs", step):
                batch, olds = forward_stage(self.trainer, samples, self.config, step, old_elsewhere=streamed_old)
        except BaseException:
            self._reference_done(step, t0, time.perf_counter(), failing=True)  # this stage's error is the one
            self._abandon_passes()
            raise
        reference = self._reference_done(step, t0, time.perf_counter())
        batch.metrics["train/reward_failed_samples"] = float(failed)
        if olds is not None and self.rank == 0 and not self._holds_every_field():
            self.data.put_fields(step, [s.index for s in batch.samples], old_logprobs=olds)
        self._batches = {step: batch}  # a step's batch replaces the last one: one step in flight per rank
        if olds is not None:  # every rank computed all of them
            self._keep_rows(step, old_logprobs=olds)
        return {"perf/old_logprob_time": time.perf_counter() - t0, **reference}

    @timeline.traced("actor advantages", cat="train")
    def advantages(self, step: int) -> dict[str, float]:
        """Advantages (rank 0 alone): from the rewards and the stage fields written so far (old, reference and
        teacher log-probs, critic values), written as `advantages` (and `returns` with ppo)."""
        t0 = time.perf_counter()
        batch = self._batch(step)
        inputs = self._written(step, ("old_logprobs", "ref_logprobs", "values", "teacher_logprobs"))
        rows = self._read_fields(batch, inputs)
        with native_device_ops():  # host tensor math alone: no CUDA-to-CPU rewriting (a Python hop per op)
            advantages, returns, _ = advantage_stage(batch, self.config, **rows)
        out = {"advantages": advantages} if returns is None else {"advantages": advantages, "returns": returns}
        if not self._holds_every_field():
            self.data.put_fields(step, [s.index for s in batch.samples], **out)
        self._keep_rows(step, advantages=advantages)
        return {"perf/advantages_time": time.perf_counter() - t0}

    @timeline.traced("actor update", cat="train")
    def train(self, step: int) -> dict[str, float]:
        """The actor's update (every rank) from the step's advantages, old and reference log-probs."""
        batch = self._batches.pop(step, None) or self._batch(step)
        passes = self._step_passes(step)
        streamed_old = passes is not None and passes.streams_old and batch.has_old_logprobs
        wanted = ["advantages"] + (["old_logprobs"] if batch.has_old_logprobs and not streamed_old else [])
        wanted += self._written(step, ("ref_logprobs",)) if passes is None else []
        rows = self._read_fields(batch, wanted)
        if passes is not None:  # rows that arrive while the updates run, each before the update that reads it
            rows["ref_logprobs"] = passes.rows(REFERENCE)
            if streamed_old:
                rows["old_logprobs"] = passes.rows(POLICY)
        self._rows.pop(step, None)
        try:
            with self.profiling.section("train_actor", step):
                metrics = update_stage(self.trainer, batch, self.config, **rows,
                                       late=("ref_logprobs",) if passes is not None else ())
            if passes is not None:
                metrics.update(self.reference.finish(passes))
        except BaseException:
            self._abandon_passes()
            raise
        self.profiling.stop("train_overall", step)
        self.profiling.memory_end()
        if self.elastic is not None:
            metrics["perf/trainer_threads_mean"] = self.elastic.mean()
        self.reporter.report("trainer", self.rank, metrics, step=step)
        return metrics

    @timeline.traced("actor chunk", cat="train")
    def train_chunk(self, step: int, chunk: int, chunks: int, indexes: list[int]) -> dict[str, float] | None:
        """Chunk `chunk` of `chunks` of step `step` (--num-iters-per-train-update, relax.training.streaming;
        every rank): its samples (`indexes`, whole prompt groups the rollout stored) read from the step's
        partition, old log-probs, advantages and the forward and backward passes of this rank's share, the
        gradients accumulated; the last chunk's call makes the step's optimizer step and returns its metrics.
        A chunk whose every reward failed stops the step (`check_step_rewards`, per chunk: its update would
        learn from those failures alone)."""
        if chunk == 0:
            self._elastic_begin()
            self.profiling.memory_begin()
            self.profiling.start("train_overall", step)
            self._streaming = {"update": StreamingUpdate(self.trainer, self.config, step), "next": 0, "failed": 0}
        state = self._streaming
        if state is None or state["update"].step != step or state["next"] != chunk:
            raise RuntimeError(f"step {step}: chunk {chunk} arrived out of order on trainer rank {self.rank}")
        # the chunk's samples alone: this rank's own reader of the partition takes the lowest unread indexes
        # with a KL loss or reward, the chunk's reference log-probs too (written by the reference role before)
        fields = (*ROLLOUT_FIELDS, "ref_logprobs") if needs_reference(self.config) else None
        samples = self.data.get(step, batch_size=len(indexes), fields=fields, task_name=f"stream-rank-{self.rank}",
                                timeout_s=float(self.config.train_step_timeout or 60))
        if [s.index for s in samples] != list(indexes):
            raise RuntimeError(f"step {step}: chunk {chunk} read samples {[s.index for s in samples][:8]}... from "
                               f"the data plane, the rollout stored {list(indexes)[:8]}...")
        state["failed"] += check_step_rewards(samples, step, reward_name(self.config))
        state["next"] = chunk + 1
        last = chunk + 1 == chunks
        with self.profiling.section("train_actor", step):
            metrics = state["update"].add(samples, last=last)
        if not last:
            return None
        self._streaming = None
        metrics["train/reward_failed_samples"] = float(state["failed"])
        self.profiling.stop("train_overall", step)
        self.profiling.memory_end()
        if self.elastic is not None:
            metrics["perf/trainer_threads_mean"] = self.elastic.mean()
        self.reporter.report("trainer", self.rank, metrics, step=step)
        return metrics

    def _batch(self, step: int):
        batch = self._batches.get(step)
        if batch is None:
            raise RuntimeError(f"step {step}: the actor's forward stage has not run on rank {self.rank}")
        return batch

    def _keep_rows(self, step: int, **rows: list[torch.Tensor]) -> None:
        """Keep rows this rank computed for every sample of the batch (float32, as the data plane stores them, so
        a later stage reads the same values either way)."""
        kept = self._rows.setdefault(step, {})
        for key in [k for k in self._rows if k != step]:
            del self._rows[key]
        for name, values in rows.items():  # the passes' rows are float32 and detached already: kept as they are
            kept[name] = [v if v.dtype == torch.float32 and not v.requires_grad else v.detach().float()
                          for v in values]

    def _holds_every_field(self) -> bool:
        """Whether every stage field of a step that this rank reads is one it computed itself: the only trainer rank
        (rank 0 alone computes the advantages the others read), no critic or teacher, and the reference (if any)
        in this process."""
        c = self.config
        if self.world_size > 1 or c.advantage_estimator == "ppo" or c.use_opd:
            return False
        if not (c.use_kl_loss or c.kl_coef):
            return True
        return self.reference is not None

    def _written(self, step: int, names: tuple[str, ...]) -> list[str]:
        """Which of the stage fields `names` the step has so far (without asking the data plane when this rank
        holds every field it reads)."""
        if self._holds_every_field():
            kept = self._rows.get(step, {})
            return [n for n in names if n in kept]
        written = self.data.written_fields(step)
        return [n for n in names if n in written]

    def _read_fields(self, batch, names: list[str]) -> dict[str, Any]:
        """The step's stage fields `names` as float32 rows aligned with the batch's samples: those this rank kept
        (`_keep_rows`), the others read from the data plane."""
        kept = self._rows.get(batch.step, {})
        out = {name: kept[name] for name in names if name in kept}
        missing = [name for name in names if name not in out]
        if not missing:
            return out
        stored = self.data.get(batch.step, fields=["index", *missing])
        if [s.index for s in stored] != [s.index for s in batch.samples]:
            raise RuntimeError(f"step {batch.step}: the data plane holds other samples than the actor's batch")
        for name in missing:
            rows = [getattr(s, name) for s in stored]
            check_rows(batch.samples, rows, name, batch.step)  # the rows follow the trained responses
            out[name] = [torch.tensor(r, dtype=torch.float32) for r in rows]
        return out

    @timeline.traced("reference log-probs", cat="train")
    def reference_logprobs(self, step: int) -> dict[str, Any]:
        """Stage, with the reference in this rank (config.reference_placement in_rank, child_process or streamed):
        the reference log-probs of this data-parallel rank's share of step `step`, written as `ref_logprobs`
        (what `ReferenceWorker.compute` does in a role of its own). The step's samples stay here for the forward
        stage that follows; no other stage writes before it when this rank holds every field
        (`_holds_every_field`)."""
        if self.reference is None:
            raise RuntimeError(f"trainer rank {self.rank} has no reference model (reference_placement "
                               f"{self.config.reference_placement})")
        t0 = time.perf_counter()
        samples = self.data.get(step)
        if self._holds_every_field():
            self._prefetched = {step: samples}
        layout = self.trainer.layout  # the reference's too (the actor's architecture and parallel layout)
        mine = samples[layout.dp_rank::layout.dp]
        self.reference.abandon()  # a step that failed before its update: its parts are dropped
        if self._holds_every_field() and mine and self.reference.overlaps:
            # Nothing reads the rows before this rank's advantages: the pass runs beside the actor's forward
            # stage, which comes next and collects it (`_reference_done`), or in parts the updates read
            # (relax.roles.reference_source)
            self.reference.begin(step, mine, self.config.rollout_temperature,
                                 self.config.global_batch_size or len(mine), self._policy_tensors)
            return {"samples": len(mine), "overlapped": True}
        logprobs = self.reference.compute(mine, self.config.rollout_temperature)
        if not self._holds_every_field():
            self.data.put_fields(step, [s.index for s in mine], ref_logprobs=logprobs)
        if layout.dp == 1:
            self._keep_rows(step, ref_logprobs=logprobs)
        return {"samples": len(mine), "seconds": time.perf_counter() - t0}

    def _reference_done(self, step: int, forward_start: float, forward_end: float,
                        failing: bool = False) -> dict[str, float]:
        """The rows of the reference pass left running beside the forward stage (kept for the advantages and the
        update) and its metrics (`ReferenceSource.forward_done`); `failing`: the forward stage raised."""
        if self.reference is None:
            return {}
        rows, metrics = self.reference.forward_done(step, forward_start, forward_end, failing)
        if rows is not None:
            self._keep_rows(step, ref_logprobs=rows)
        return metrics

    def _step_passes(self, step: int) -> StepPasses | None:
        return self.reference.passes(step) if self.reference is not None else None

    def _abandon_passes(self) -> None:
        if self.reference is not None:
            self.reference.abandon()

    def _policy_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's model tensors (the state dict's, not copied): the policy that generated the step's samples,
        for the reference process's old-policy rows."""
        gather_params(self.trainer.model)  # --overlap-param-gather: the other ranks' shards of the last step
        return [(name, t) for name, t in unwrap_model(self.trainer.model).state_dict().items()
                if isinstance(t, torch.Tensor)]

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
        if self.config.keep_old_actor:  # the policy the engines roll out with until the next push
            self.trainer.keep_weights("old_actor")
        if adapter_sync(self.config):  # LoRA: only the adapter moves (relax.backends.megatron.lora_sync)
            return push_adapter_for_config(self.trainer, engine_urls, version, self.config)
        named = list(self.trainer.export_hf_weights())
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
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        mine = [(name, t.detach().cpu()) for name, t in named]
        stages = [None] * layout.pp if self.rank == 0 else None
        dist.gather_object(mine, stages, dst=0, group=group)
        if self.rank != 0:
            return []
        return [item for stage in stages for item in stage]

    def model_state(self) -> dict[str, Any]:
        return self.trainer.model_state()
