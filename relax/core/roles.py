"""The roles besides the actor and the rollout that a run's config needs, and when each is needed.

Each is a group of Ray actors (one per actor rank, the actor's parallel layout, in its own placement group),
created by `launch_aux_groups` (early, so their start-up overlaps the other roles') and set up by
`build_aux_roles`; `AuxRoles` holds them (None where not needed). Their per-step work is a stage of the
step (relax.core.stages), which reads the step's samples from the data plane and writes its result back as a
stage field:
  * reference (--use-kl-loss / --kl-coef): `compute(step)` writes `ref_logprobs`; every
    --ref-update-interval steps the actor ranks copy their weights into it after the update. In a synchronous
    run without GPUs it is no role of its own: the actor's rank processes hold the reference model and compute
    the same rows (`config.reference_placement`, relax.config.facts; `AuxRoles.reference_in_trainer`);
  * teacher (--use-opd --opd-type megatron): `compute(step)` writes `teacher_logprobs`; with --opd-type sglang
    the teacher is an SGLang-API server at --rm-url instead of a role
    (relax.rollout.teacher_client.SGLangTeacher, called from the controller with the same interface);
  * critic (--advantage-estimator ppo): `compute(step)` writes `values`; `train(step)` updates it (clipped value
    loss) from the values and the GAE `returns` the advantage stage wrote. The critic is saved under
    `<iter dir>/critic`, or `<--critic-save>/iter_XXXXXXX/critic` (a save root of its own, with its own marker).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relax.formats import checkpoint_layout
from relax.config.env import role_runtime_env, threads_per_process, worker_env
from relax.core.calls import wait_all
from relax.core.deadlines import FLAGS, Call
from relax.core.checkpointing import keep_limit, rotate_checkpoints
from relax.roles.placement import create_placement_group
from relax.roles.critic import CriticWorker
from relax.roles.reference import ReferenceWorker
from relax.config.facts import IN_ACTOR_RANKS, REFERENCE_ROLE
from relax.rollout.teacher_client import SGLangTeacher

logger = logging.getLogger(__name__)


def needs_critic(config: Any) -> bool:
    return config.advantage_estimator == "ppo"


def needs_teacher(config: Any) -> bool:
    return bool(config.use_opd) and config.opd_type == "megatron"


class WorkerGroup:
    """One worker per actor rank, built by `worker_cls.options(...).remote(config, rank, world, threads, *args)`,
    set up together (their own torch.distributed group), in a placement group named `relax-<name>`.

    Two phases, so that start-up overlaps: the constructor only creates the actors (their processes start and
    import in the background while the controller starts the other roles); `setup()` waits for them and builds
    their models."""

    def __init__(self, name: str, worker_cls: Any, config: Any, *, use_gpu: bool, args: tuple = ()):
        self.name = name
        self.config = config
        self.use_gpu = use_gpu
        self.workers: list[Any] = []
        self.infos: list[dict[str, Any]] = []
        self.placement_group = None
        world = config.actor_world_size
        bundles = [{"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0} for _ in range(world)]
        self.placement_group = create_placement_group(bundles, f"relax-{name}")
        threads = threads_per_process(world)
        env = role_runtime_env(worker_env(config.train_env_vars, training_role=True))
        self.workers = [
            worker_cls.options(num_cpus=1, num_gpus=1 if use_gpu else 0, runtime_env=env,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   placement_group=self.placement_group, placement_group_bundle_index=rank)
                               ).remote(config, rank, world, threads, *args)
            for rank in range(world)
        ]

    def setup(self) -> "WorkerGroup":
        """Wait for the ranks to start, join their process group and build their models; shuts the group down
        if that fails."""
        world = len(self.workers)
        try:
            # within --train-step-timeout and in short slices, like the actor's own ranks (relax.core.calls)
            deadline = self.config.train_step_timeout or None
            addr, port = wait_all([self.workers[0].master_address.remote()], [Call(self.name, "start", rank=0)],
                                  deadline_s=deadline, flag=FLAGS["train"])[0]
            backend = self.config.distributed_backend if self.use_gpu else "gloo"
            self.infos = wait_all([w.setup.remote(addr, port, backend) for w in self.workers],
                                  [Call(self.name, "setup", rank=r) for r in range(world)], deadline_s=deadline,
                                  flag=FLAGS["train"])
        except BaseException:
            self.shutdown()
            raise
        logger.info("%s: %d rank(s), weights from %s", self.name, world, self.infos[0]["source"])
        return self

    def compute(self, step: int, indexes: list[int] | None = None) -> float:
        """The group's stage of step `step` (of its chunk `indexes` when streamed): every rank writes its share's
        rows to the data plane. Returns the slowest rank's seconds."""
        # a chunk only for the groups that stream (ReferenceWorker); the critic's stage takes whole steps
        parts = ray.get([w.compute.remote(step) if indexes is None else w.compute.remote(step, indexes)
                         for w in self.workers])
        return max(p["seconds"] for p in parts)

    def save(self, path: str) -> None:
        ray.get([w.save.remote(path) for w in self.workers])

    def load(self, path: str) -> None:
        ray.get([w.load.remote(path) for w in self.workers])

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.get(w.shutdown.remote(), timeout=30)
            except Exception:
                pass
            try:
                ray.kill(w)
            except Exception:
                pass
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass
            self.placement_group = None


class ReferenceGroup(WorkerGroup):
    """The reference role: one `ReferenceWorker` per actor rank; its stage writes `ref_logprobs`."""

    def __init__(self, config: Any, *, use_gpu: bool):
        super().__init__("reference", ReferenceWorker, config, use_gpu=use_gpu, args=("reference",))


class TeacherGroup(WorkerGroup):
    """The on-policy-distillation teacher: forward-only `ReferenceWorker`s with role "teacher"; its stage writes
    `teacher_logprobs`."""

    def __init__(self, config: Any, *, use_gpu: bool):
        super().__init__("teacher", ReferenceWorker, config, use_gpu=use_gpu, args=("teacher",))


class CriticGroup(WorkerGroup):
    """The critic role: one `CriticWorker` per actor rank; its stages write `values` and update the critic."""

    def __init__(self, config: Any, *, use_gpu: bool):
        super().__init__("critic", CriticWorker, config, use_gpu=use_gpu)

    def train(self, step: int) -> dict[str, float]:
        return ray.get([w.train.remote(step) for w in self.workers])[0]


class AuxRoles:
    """The auxiliary role groups of a run (None where the config needs none) and their checkpoints."""

    def __init__(self, config: Any, reference: ReferenceGroup | None = None, critic: CriticGroup | None = None,
                 teacher: Any = None):  # a TeacherGroup, or an SGLangTeacher (--opd-type sglang)
        self.config = config
        self.reference = reference
        # the reference log-probs come from the actor's ranks (TrainerWorker.reference_logprobs), not a group
        self.reference_in_trainer = config.reference_placement in IN_ACTOR_RANKS
        self.critic = critic
        self.teacher = teacher

    def names(self) -> list[str]:
        return [n for n in ("reference", "teacher", "critic") if getattr(self, n) is not None]

    def _critic_dir(self, path: str) -> Path:
        if self.config.critic_save:
            return Path(self.config.critic_save) / Path(path).name / "critic"
        return Path(path) / "critic"

    def save(self, path: str) -> None:
        if self.reference is not None and self.config.ref_update_interval:
            self.reference.save(str(Path(path) / "reference"))
        if self.critic is not None:
            if self.config.critic_save:
                save_to_own_root(self.critic, Path(self.config.critic_save), Path(path).name, self.config)
            else:  # inside the actor's staged checkpoint, which is renamed into place as a whole
                self.critic.save(str(Path(path) / "critic"))

    def load(self, path: str) -> None:
        if self.reference is not None and checkpoint_layout.is_saved(Path(path) / "reference"):
            self.reference.load(str(Path(path) / "reference"))
        if self.critic is not None:
            for where in (self._critic_dir(path), Path(path) / "critic"):
                if checkpoint_layout.is_saved(where):
                    self.critic.load(str(where))
                    break
            else:
                logger.warning("resuming from %s without a critic checkpoint; the critic keeps its initial "
                               "weights", path)

    def shutdown(self) -> None:
        for name in ("reference", "teacher", "critic"):
            group = getattr(self, name)
            if group is not None:
                group.shutdown()
                setattr(self, name, None)


def launch_aux_groups(config: Any, *, use_gpu: bool) -> dict[str, WorkerGroup]:
    """Create the Ray actors of the auxiliary role groups this config needs, without waiting for them: a
    reference for --use-kl-loss / --kl-coef, a teacher for --use-opd --opd-type megatron, a critic for
    --advantage-estimator ppo. `build_aux_roles` sets them up."""
    groups: dict[str, WorkerGroup] = {}
    if config.debug_rollout_only:
        return groups
    try:
        if config.reference_placement == REFERENCE_ROLE:
            groups["reference"] = ReferenceGroup(config, use_gpu=use_gpu)
        if needs_teacher(config):
            groups["teacher"] = TeacherGroup(config, use_gpu=use_gpu)
        if needs_critic(config):
            groups["critic"] = CriticGroup(config, use_gpu=use_gpu)
    except BaseException:
        for group in groups.values():
            group.shutdown()
        raise
    return groups


def build_aux_roles(config: Any, *, use_gpu: bool, data_plane: Any,
                    launched: dict[str, WorkerGroup] | None = None) -> AuxRoles:
    """Set up the auxiliary role groups (`launched` by `launch_aux_groups`, or launched here) and, for
    --opd-type sglang, the HTTP client of --rm-url that stands in for the teacher group."""
    if config.debug_rollout_only:
        return AuxRoles(config)
    groups: dict[str, Any] = dict(launched) if launched is not None else launch_aux_groups(config, use_gpu=use_gpu)
    try:
        for group in groups.values():
            group.setup()
        if config.use_opd and config.opd_type == "sglang":
            groups["teacher"] = SGLangTeacher.from_config(config, data_plane)
    except BaseException:
        for group in groups.values():
            group.shutdown()
        raise
    return AuxRoles(config, groups.get("reference"), critic=groups.get("critic"), teacher=groups.get("teacher"))


def save_to_own_root(group: Any, root: Path, name: str, config: Any) -> Path:
    """Save `group` as `root/<name>/critic` (`name`: the run checkpoint's `iter_XXXXXXX`) the way run
    checkpoints are saved: staged, renamed into place, then marked (so --critic-load never sees a partial
    save), and old iterations rotated with --max-actor-ckpt-to-keep / --rotate-ckpt."""
    rollout_id = int(name.rsplit("_", 1)[-1])
    root.mkdir(parents=True, exist_ok=True)
    checkpoint_layout.remove_leftovers(root)
    group.save(str(checkpoint_layout.staging_dir(root, rollout_id) / "critic"))
    final = checkpoint_layout.commit_iteration(root, rollout_id)
    keep = keep_limit(config)
    if keep:
        rotate_checkpoints(root, keep)
    return final
