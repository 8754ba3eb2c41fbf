"""Reference role: a forward-only Megatron model per rank (same parallel layout as the actor) that computes the
reference log-probs of a step's samples, read from the data plane.

Weights: `--ref-load` (a Relax checkpoint written by `MegatronTrainer.save_checkpoint`, a save root, or an HF
folder; `--ref-ckpt-step` picks the iteration of a save root) if given, else `--hf-checkpoint`. With
`--ref-update-interval N` the actor ranks copy their weights into their reference peers every N steps.

The on-policy-distillation teacher (`--use-opd --opd-type megatron`) is the same worker with role "teacher":
weights from `--opd-teacher-load` (`--opd-teacher-ckpt-step`): an HF folder (its own architecture, which may
differ from the student's but must share its tokenizer) or a Relax checkpoint (the architecture recorded in
it, else the student's).

The model is the actor's (`relax.formats.model_arch.arch_for_run`): the `--hf-checkpoint` config's, or the
one Megatron's architecture flags describe when there is no HF folder.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch

from relax import heap
from relax.formats.model_arch import ModelArch, arch_for_run
from relax.formats.checkpoint_layout import read_meta, resolve_model_checkpoint
from relax.data.plane import DataPlane
from relax.observability import timeline
from relax.roles.megatron_rank import MegatronRank
from relax.roles.megatron_settings import build_reference_trainer, trainer_settings


def _checkpoint_arch(kind: str, where) -> Any:
    """The architecture of an HF folder, or the one a Relax checkpoint recorded (None if it has none)."""
    if kind == "hf":
        from transformers import AutoConfig  # not at the top: the driver imports this module
        return ModelArch.from_hf_config(AutoConfig.from_pretrained(str(where)))
    arch = read_meta(where).get("arch")
    if not arch:
        return None
    return ModelArch(**{k: tuple(v) if isinstance(v, list) else v for k, v in arch.items()})


@ray.remote
class ReferenceWorker(MegatronRank):
    """One rank of the reference group. All ranks are called together for collectives."""

    def __init__(self, config: Any, rank: int, world_size: int, threads: int = 1, role: str = "reference"):
        if role not in ("reference", "teacher"):
            raise ValueError(f"unknown forward-only role {role!r}")
        super().__init__(config, rank, world_size, threads)
        self.role = role

    def setup(self, master_addr: str, master_port: int, backend: str) -> dict[str, Any]:
        self.join_process_group(master_addr, master_port, backend)
        settings = trainer_settings(self.config, forward_only=True)
        if self.role == "teacher":
            kind, where = resolve_model_checkpoint(self.config.opd_teacher_load, self.config.opd_teacher_ckpt_step)
            arch = _checkpoint_arch(kind, where) or arch_for_run(self.config)
            from relax.backends.megatron.trainer import MegatronTrainer  # not at the top: loads Megatron-core

            self.trainer = MegatronTrainer(arch, settings)
            source = self.trainer.load_weights(where)
            self.data = DataPlane.attach()
            heap.freeze()  # the model lives as long as the rank (relax.heap)
            return {"rank": self.rank, "dp": self.trainer.layout.dp, "source": f"{source} {where}"}
        # The actor's model (relax.roles.trainer.TrainerWorker.setup): --ref-update-interval copies its state here.
        self.trainer, source = build_reference_trainer(self.config)
        self.data = DataPlane.attach()
        heap.freeze()
        return {"rank": self.rank, "dp": self.trainer.layout.dp, "source": source}

    @timeline.traced("log-probs", cat="train")
    def compute(self, step: int, indexes: list[int] | None = None) -> dict[str, Any]:
        """Stage: the log-probs of this data-parallel rank's share (samples[dp_rank::dp]) of step `step`, written
        to the data plane as `ref_logprobs` (`teacher_logprobs` for the teacher). `indexes`: one streamed chunk
        of the step (--num-iters-per-train-update), read as this rank's next unread samples of the partition,
        which are that chunk's (the chunks arrive in index order)."""
        t0 = time.perf_counter()
        fields = ("index", "prompt_tokens", "response_tokens")
        if indexes is None:
            samples = self.data.get(step, fields=fields)
        else:
            samples = self.data.get(step, batch_size=len(indexes), fields=fields,
                                    task_name=f"{self.role}-chunks-rank-{self.rank}",
                                    timeout_s=float(self.config.train_step_timeout or 60))
            if [s.index for s in samples] != list(indexes):
                raise RuntimeError(f"step {step}: the {self.role} read samples {[s.index for s in samples][:8]}... "
                                   f"for a chunk the rollout stored as {list(indexes)[:8]}...")
        layout = self.trainer.layout
        mine = samples[layout.dp_rank::layout.dp]
        inputs = [{"tokens": torch.tensor(s.prompt_tokens + s.response_tokens, dtype=torch.long),
                   "response_length": len(s.response_tokens)} for s in mine]
        with self.computing(self.role):
            logprobs = self.trainer.compute_logprobs(inputs, self.config.rollout_temperature) if inputs else []
        name = "teacher_logprobs" if self.role == "teacher" else "ref_logprobs"
        self.data.put_fields(step, [s.index for s in mine], **{name: logprobs})
        return {"samples": len(mine), "seconds": time.perf_counter() - t0}

    def set_model_state(self, state: dict[str, Any]) -> None:
        self.trainer.set_model_state(state)
