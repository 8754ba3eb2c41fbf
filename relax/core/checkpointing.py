"""Run checkpoints: which roles save what, and when; rotation; resuming.

A run checkpoint under --save is one iteration folder of the trainer backend's save root
(`relax.formats.checkpoint_layout` describes the files and the crash-safe protocol; the backend
writes and reads them): the actor's trainer state (model, optimizer, scheduler, RNG), the auxiliary roles
that are saved (reference, critic) and the rollout position (data source, sample counter).

Flags: `--no-save-optim` (no optimizer state; resuming training from such a checkpoint fails with a
clear message unless `--no-load-optim`, which loads weights and RNG only and starts a fresh optimizer),
`--max-actor-ckpt-to-keep N` / `--rotate-ckpt` (after a save, delete the oldest `iter_*` beyond N; N is 1
for `--rotate-ckpt` alone), `--save-hf PATH` (HF safetensors + config + tokenizer of the trainer's
weights, from `export_hf_weights`; PATH may contain {rollout_id}), `--async-save` (each trainer rank
snapshots its state to CPU memory and writes it from a background thread while training continues;
a controller thread completes and marks the checkpoint when every rank is done; the next save waits for
it, and the last save of the run is synchronous), `--save-retain-interval N` (a rotation never deletes an
iteration that is a multiple of N; alone it rotates like Megatron-LM: only the last checkpoint besides those).

What a resume restores (`resume_from`): `--load` (its latest iteration, or `--ckpt-step`'s), with everything
unless `--no-load-optim` / `--no-load-rng`; `--finetune` loads the weights alone and starts at step 0 (fresh
optimizer and LR schedule, the trainer's RNG and the rollout position not restored, as Megatron-LM's
--finetune); `--pretrained-checkpoint` is where the weights come from (with --finetune's meaning) while
`--load` holds no checkpoint yet.

The trainer-side parts run inside each `TrainerWorker` actor through Ray's `__ray_call__`. They import the
backend's checkpoint module, which loads Megatron-core, where they run rather than at the top: the driver imports
this module as well, and Megatron's import would cost it seconds of CPU at every launch.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

import ray

from relax.formats import checkpoint_layout as layout
from relax.formats.checkpoint_layout import (MARKER, iter_dir, iterations_to_delete, latest_iteration,
                                                       select_iteration)

logger = logging.getLogger("relax")


class CheckpointError(RuntimeError):
    pass


# ============================================================================ trainer side (in the actor)
def _worker_wait_previous(worker: Any) -> None:
    # An actor that has never saved has no pending write yet.
    pending = getattr(worker, "_relax_ckpt_pending", None)
    if pending is None:
        return
    thread, box = pending
    thread.join()
    worker._relax_ckpt_pending = None
    if box.get("error") is not None:
        raise CheckpointError(f"trainer rank {worker.rank}: the background checkpoint write failed: {box['error']}")


def _worker_save(worker: Any, actor_dir: str, save_optim: bool, background: bool,
                 hf_dir: Optional[str]) -> dict[str, Any]:
    """Snapshot this rank's trainer state and write it under `actor_dir` (now, or from a background thread).
    With `hf_dir`, also export the HF weights (collective) and write this pipeline stage's part there."""
    from relax.backends.megatron.checkpoint import snapshot_rank, write_rank

    _worker_wait_previous(worker)
    snap = snapshot_rank(worker.trainer, save_optim=save_optim, hf=hf_dir is not None)
    result = {"rank": snap.rank, "meta": snap.meta, "hf": snap.hf_part()}
    if not background:
        write_rank(snap, actor_dir, hf_dir)
        return result
    box: dict[str, Any] = {"error": None}

    def run() -> None:
        try:
            write_rank(snap, actor_dir, hf_dir)
        except BaseException as exc:  # reported by the next poll
            box["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run, name="relax-async-ckpt", daemon=True)
    worker._relax_ckpt_pending = (thread, box)
    thread.start()
    return result


def _worker_save_status(worker: Any) -> str:
    """"done", "running", or raises if the background write failed."""
    pending = getattr(worker, "_relax_ckpt_pending", None)  # absent until the first save
    if pending is None:
        return "done"
    if pending[0].is_alive():
        return "running"
    _worker_wait_previous(worker)
    return "done"


def _worker_load_weights_only(worker: Any, actor_dir: str) -> int:
    from relax.backends.megatron.checkpoint import load_weights_only

    return load_weights_only(worker.trainer, actor_dir)


def _worker_load_model_only(worker: Any, path: str, step: Optional[int]) -> str:
    """--finetune / --pretrained-checkpoint: the weights alone (a Relax checkpoint or an HF folder); the optimizer,
    scheduler, RNG and the trainer's iteration count stay those of a fresh start."""
    return worker.trainer.load_weights(path, step)


# ============================================================================ driver side
class _Pending:
    """An async save in flight: the thread that waits for the trainer ranks, then completes it."""

    def __init__(self, rollout_id: int, thread: threading.Thread, box: dict):
        self.rollout_id, self.thread, self.box = rollout_id, thread, box


# the save root (resolved) -> its async save in flight: a root has at most one, and its next save waits for it
_PENDING: dict[str, _Pending] = {}


def wait_for_pending_save(save_root: str | Path) -> None:
    """Block until an async save under `save_root` is complete (its marker written); raise if it failed."""
    pending = _PENDING.pop(str(Path(save_root).resolve()), None)
    if pending is None:
        return
    pending.thread.join()
    if pending.box.get("error") is not None:
        raise CheckpointError(f"async checkpoint {pending.rollout_id} failed: {pending.box['error']}")


def keep_limit(config: Any) -> Optional[int]:
    """How many iterations a save root keeps (--max-actor-ckpt-to-keep, 1 for --rotate-ckpt alone); the multiples
    of --save-retain-interval are kept besides them (`rotate_checkpoints`)."""
    keep = config.max_actor_ckpt_to_keep
    if keep is None and config.rotate_ckpt:
        keep = 1
    return int(keep) if keep else None


def _hf_path(config: Any, rollout_id: int) -> Optional[Path]:
    if not config.save_hf:
        return None
    return Path(str(config.save_hf).replace("{rollout_id}", str(rollout_id)))


def save_checkpoint(config: Any, workers: list[Any], aux: Any, rollout_state: Any, rollout_id: int,
                    final: bool = False) -> Path:
    """Save the run at `rollout_id` under --save (see the module docstring): the trainer ranks `workers`, the
    auxiliary roles `aux` (relax.core.roles.AuxRoles, or None) and the rollout position `rollout_state` (the
    rollout manager's `state_dict()` after the saved step). Returns the iter_* path (with --async-save it appears
    once the background write is done). `final`: the run stops after this save (its last step, or an early stop
    of relax.core.run_control), so it is written synchronously."""
    root = Path(config.save)
    root.mkdir(parents=True, exist_ok=True)
    wait_for_pending_save(root)
    layout.remove_leftovers(root)
    path = iter_dir(root, rollout_id)
    tmp = layout.staging_dir(root, rollout_id)
    tmp.mkdir(parents=True)
    hf_final = _hf_path(config, rollout_id)
    hf_tmp = hf_final.with_name(hf_final.name + ".tmp") if hf_final is not None else None
    if hf_tmp is not None and hf_tmp.exists():
        shutil.rmtree(hf_tmp)
    last = final or rollout_id >= (config.num_rollout or 0)
    background = config.async_save and not last
    save_optim = not config.no_save_optim
    t0 = time.perf_counter()
    infos = ray.get([w.__ray_call__.remote(_worker_save, str(tmp / "actor"), save_optim, background,
                                           str(hf_tmp) if hf_tmp is not None else None)
                     for w in workers])
    if aux is not None:
        aux.save(str(tmp))
    meta = next(i["meta"] for i in infos if i["meta"] is not None)
    hf_parts = [i["hf"] for i in infos if i.get("hf")]

    def complete() -> None:
        if background:
            _wait_workers(workers)
        _finish(root, rollout_id, tmp, meta, rollout_state, config, hf_tmp, hf_final, hf_parts)
        logger.info("checkpoint %d saved to %s in %.1fs%s", rollout_id, path, time.perf_counter() - t0,
                    " (async)" if background else "")

    if not background:
        complete()
        return path
    box: dict[str, Any] = {"error": None}

    def run() -> None:
        try:
            complete()
        except BaseException as exc:
            box["error"] = f"{type(exc).__name__}: {exc}"
            logger.error("async checkpoint %d failed: %s", rollout_id, box["error"])

    thread = threading.Thread(target=run, name=f"relax-ckpt-{rollout_id}", daemon=True)
    _PENDING[str(root.resolve())] = _Pending(rollout_id, thread, box)
    thread.start()
    return path


def _wait_workers(workers: list, poll_s: float = 0.2) -> None:
    waiting = list(workers)
    while waiting:
        states = ray.get([w.__ray_call__.remote(_worker_save_status) for w in waiting])
        waiting = [w for w, s in zip(waiting, states) if s != "done"]
        if waiting:
            time.sleep(poll_s)


def _write_rollout_state(tmp: Path, rollout_id: int, rollout_state: Any) -> None:
    layout.write_run_state(tmp, rollout_id, rollout_state)


def _finish(root: Path, rollout_id: int, tmp: Path, meta: dict, rollout_state: Any, config: Any,
            hf_tmp: Optional[Path], hf_final: Optional[Path], hf_parts: list) -> None:
    """Every rank's files are written: complete the checkpoint, rename it into place, then mark it."""
    layout.write_meta(tmp / "actor", meta)
    _write_rollout_state(tmp, rollout_id, rollout_state)
    layout.commit_iteration(root, rollout_id)
    if hf_tmp is not None:
        from relax.backends.megatron.checkpoint import finish_hf_folder

        finish_hf_folder(hf_tmp, hf_parts, config.hf_checkpoint)
        if hf_final.exists():
            shutil.rmtree(hf_final)
        hf_tmp.rename(hf_final)
        logger.info("Hugging Face weights written to %s", hf_final)
    keep, retain = keep_limit(config), config.get("save_retain_interval")
    if keep or retain:
        rotate_checkpoints(root, keep, retain)


def rotate_checkpoints(root: str | Path, keep: Optional[int], retain_interval: Optional[int] = None) -> list[Path]:
    """Delete the oldest `iter_*` folders beyond `keep`, except multiples of `retain_interval` and the one the
    marker names (`layout.iterations_to_delete`)."""
    iters = dict(layout.iterations(root))
    removed = []
    for it in iterations_to_delete(list(iters), keep, retain_interval, latest_iteration(root)):
        shutil.rmtree(iters[it], ignore_errors=True)
        removed.append(iters[it])
    if removed:
        logger.info("removed old checkpoints: %s", ", ".join(p.name for p in removed))
    return removed


# ============================================================================ resume
def resume_from(config: Any, workers: list[Any], aux: Any, rollout: Any, engine_urls: list[str],
                load: Optional[str]) -> int:
    """Restore the run from --load (see the module docstring) into the trainer ranks `workers`, the auxiliary
    roles `aux` and the rollout manager `rollout`, and push the loaded weights to `engine_urls`; with no
    checkpoint there, start from --pretrained-checkpoint's weights when it is given, else from step 0 as built.
    Returns the step the run starts at."""
    parts = (config, workers, engine_urls)
    # --ckpt-step picks an iteration of the checkpoint that is loaded: --load's once it holds one, else the
    # pretrained one (as in Megatron-LM, whose --pretrained-checkpoint is read only while --load holds none)
    step = config.get("ckpt_step")
    has_checkpoint = bool(load) and latest_iteration(load) is not None
    rollout_id = select_iteration(load, step) if has_checkpoint else None
    if rollout_id is None:
        pretrained = config.get("pretrained_checkpoint")
        if pretrained:
            return _load_model_only(*parts, pretrained, step, "--pretrained-checkpoint")
        if load:
            logger.info("--load %s holds no checkpoint yet; starting from step 0", load)
        return 0
    path = iter_dir(load, rollout_id)
    if config.get("finetune"):
        return _load_model_only(*parts, str(path), None, f"--load {load} with --finetune")
    actor = path / "actor"
    if not layout.is_saved(actor):
        raise CheckpointError(f"--load {load}: iteration {rollout_id} is not a complete checkpoint "
                              f"({actor / layout.META_FILE} is missing; {MARKER} names {latest_iteration(load)})")
    meta = layout.read_meta(actor)
    if not meta.get("optimizer_saved", True) and not config.no_load_optim:
        raise CheckpointError(
            f"--load {load}: checkpoint {path.name} was saved with --no-save-optim and holds no optimizer state, "
            "so training cannot resume from it exactly. Add --no-load-optim to load its weights (and RNG) with a "
            "fresh optimizer, or resume from a checkpoint saved without --no-save-optim.")
    if config.no_load_optim:
        logger.warning("--no-load-optim: loading only the weights and RNG of %s; the optimizer and LR schedule "
                       "start fresh", path)
        ray.get([w.__ray_call__.remote(_worker_load_weights_only, str(actor)) for w in workers])
    else:
        ray.get([w.load.remote(str(actor)) for w in workers])
    if aux is not None:
        aux.load(str(path))
    ray.get(rollout.load_state_dict.remote(layout.read_run_state(path)))
    start = config.start_rollout_id
    start_step = rollout_id if start is None else start
    _push_loaded_weights(*parts, rollout_id)
    logger.info("resumed from %s at rollout step %d", path, start_step)
    newer = [i for i, _ in layout.iterations(load) if i > rollout_id]
    if step is not None and newer and config.save and Path(config.save).resolve() == Path(load).resolve():
        logger.warning("--ckpt-step %d: --save %s also holds later iterations %s of an earlier run; this run's saves "
                       "of the same steps replace them", rollout_id, config.save, newer)
    return start_step


def _load_model_only(config: Any, workers: list[Any], engine_urls: list[str], path: str, step: Optional[int],
                     what: str) -> int:
    """Megatron-LM's --finetune: the weights of `path` (a Relax checkpoint, save root or HF folder) into every
    trainer rank; the run starts at step 0 (or --start-rollout-id) with a fresh optimizer, LR schedule and
    rollout position, and the engines get these weights before the first rollout."""
    kinds = ray.get([w.__ray_call__.remote(_worker_load_model_only, path, step) for w in workers])
    start = config.start_rollout_id
    start_step = 0 if start is None else start
    _push_loaded_weights(config, workers, engine_urls, start_step)
    logger.info("%s: loaded the weights of %s (%s) only; starting at rollout step %d with a fresh optimizer, LR "
                "schedule and rollout position", what, path, kinds[0], start_step)
    return start_step


def _push_loaded_weights(config: Any, workers: list[Any], engine_urls: list[str], version: int) -> None:
    """The engines serve the weights just loaded (as `version`) before the first rollout."""
    if engine_urls:
        ray.get([w.push_weights.remote(engine_urls, version, config.update_weight_buffer_size) for w in workers])
