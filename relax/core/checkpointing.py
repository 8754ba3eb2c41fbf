"""Run checkpoints: trainer state (model, optimizer, scheduler, RNG) + rollout position, saved atomically.

Layout under --save:

    iter_<rollout_id:07d>/actor/meta.json             iteration, parallel layout, arch, optimizer_saved
    iter_<rollout_id:07d>/actor/scheduler.pt          (rank 0)
    iter_<rollout_id:07d>/actor/rank<R:05d>.pt        per trainer rank: model shard, optimizer state, RNG
    iter_<rollout_id:07d>/<aux role>/...              reference / critic, when they are saved
    iter_<rollout_id:07d>/relax_state.json            rollout position (data source, sample counter)
    latest_checkpointed_iteration.txt                 written last: a checkpoint counts once it names it

Crash safety: everything of one checkpoint is written under `.tmp_iter_<id>/iter_<id>/` and renamed to
`iter_<id>` once complete; the marker is replaced (write + rename) only after that. A run killed at any
point of a save leaves the previous checkpoint, and the marker that names it, intact; the next save
removes the leftovers.

Flags: `--no-save-optim` (no optimizer state; resuming training from such a checkpoint fails with a
clear message unless `--no-load-optim`, which loads weights and RNG only and starts a fresh optimizer),
`--max-actor-ckpt-to-keep N` / `--rotate-ckpt` (after a save, delete the oldest `iter_*` beyond N; N is 1
for `--rotate-ckpt` alone), `--save-hf PATH` (HF safetensors + config + tokenizer of the trainer's
weights, from `export_hf_weights`; PATH may contain {rollout_id}), `--async-save` (each trainer rank
snapshots its state to CPU memory and writes it from a background thread while training continues;
a controller thread renames and marks the checkpoint when every rank is done; the next save waits for
it, and the last save of the run is synchronous).

The trainer-side parts run inside each `TrainerWorker` actor through Ray's `__ray_call__`.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

import ray

logger = logging.getLogger("relax")

MARKER = "latest_checkpointed_iteration.txt"
_ITER_RE = re.compile(r"^iter_(\d{7})$")


class CheckpointError(RuntimeError):
    pass


def iter_dir(root: str | Path, rollout_id: int) -> Path:
    return Path(root) / f"iter_{rollout_id:07d}"


def _opt(config: Any, name: str, default: Any = None) -> Any:
    try:
        value = config[name]
    except (KeyError, TypeError):
        value = getattr(config, name, default)
    return default if value is None else value


# ============================================================================ trainer side (in the actor)
def _cpu_copy(obj: Any) -> Any:
    """A deep copy with every tensor cloned to CPU memory (a snapshot training cannot change)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _cpu_copy(v)
        if hasattr(obj, "_metadata"):  # nn.Module.state_dict's version info
            out._metadata = copy.deepcopy(obj._metadata)
        return out
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".part")
    torch.save(obj, tmp)
    tmp.replace(path)


def _worker_wait_previous(worker: Any) -> None:
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
    from dataclasses import asdict

    import torch
    import torch.distributed as dist

    from relax.backends.megatron.checkpoint import _FORMAT, _layout_key, optimizer_state, rng_state
    from relax.backends.megatron.cpu_compat import apply_cpu_compat
    from relax.backends.megatron.hf_weights import unwrap_model

    _worker_wait_previous(worker)
    trainer = worker.trainer
    apply_cpu_compat()
    rank = dist.get_rank()
    with torch.no_grad():
        state = {
            "model": _cpu_copy(unwrap_model(trainer.model).state_dict()),
            "optimizer": (_cpu_copy(optimizer_state(trainer.optimizer))
                          if save_optim and trainer.optimizer is not None else None),
            "rng": _cpu_copy(rng_state()),
        }
        scheduler = (_cpu_copy(trainer.scheduler.state_dict())
                     if rank == 0 and trainer.scheduler is not None else None)
        hf_part, hf_file = None, None
        if hf_dir:
            named = [(n, t.detach().to("cpu", copy=True).contiguous()) for n, t in trainer.export_hf_weights()]
            from megatron.core import parallel_state as ps

            writer = (ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
                      and ps.get_context_parallel_rank() == 0)
            if writer:
                pp, stage = trainer.layout.pp, ps.get_pipeline_model_parallel_rank()
                hf_file = "model.safetensors" if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"
                hf_part = named
    meta = None
    if rank == 0:
        meta = {"format": _FORMAT, "iteration": trainer.iteration, "layout": _layout_key(trainer.layout),
                "arch": asdict(trainer.arch), "settings": asdict(trainer.settings),
                "optimizer_saved": bool(save_optim and trainer.optimizer is not None)}

    def write() -> None:
        out = Path(actor_dir)
        out.mkdir(parents=True, exist_ok=True)
        _atomic_torch_save(state, out / f"rank{rank:05d}.pt")
        if scheduler is not None:
            _atomic_torch_save(scheduler, out / "scheduler.pt")
        if hf_part is not None:
            from relax.weights.sync import _unshared

            from safetensors.torch import save_file

            Path(hf_dir).mkdir(parents=True, exist_ok=True)
            save_file(_unshared(dict(hf_part)), str(Path(hf_dir) / hf_file), metadata={"format": "pt"})

    result = {"rank": rank, "meta": meta,
              "hf": {"file": hf_file, "names": [n for n, _ in hf_part],
                     "bytes": sum(t.numel() * t.element_size() for _, t in hf_part)} if hf_part else None}
    if not background:
        write()
        return result
    box: dict[str, Any] = {"error": None}

    def run() -> None:
        try:
            write()
        except BaseException as exc:  # reported by the next poll
            box["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=run, name="relax-async-ckpt", daemon=True)
    worker._relax_ckpt_pending = (thread, box)
    thread.start()
    return result


def _worker_save_status(worker: Any) -> str:
    """"done", "running", or raises if the background write failed."""
    pending = getattr(worker, "_relax_ckpt_pending", None)
    if pending is None:
        return "done"
    if pending[0].is_alive():
        return "running"
    _worker_wait_previous(worker)
    return "done"


def _worker_load_weights_only(worker: Any, actor_dir: str) -> int:
    """--no-load-optim: model weights and RNG of a checkpoint; the optimizer and scheduler start fresh."""
    import torch.distributed as dist

    from relax.backends.megatron.checkpoint import load_state_file, set_rng_state

    trainer = worker.trainer
    trainer.load_weights(actor_dir)
    state = load_state_file(Path(actor_dir) / f"rank{dist.get_rank():05d}.pt")
    set_rng_state(state["rng"])
    trainer.iteration = int(json.loads((Path(actor_dir) / "meta.json").read_text())["iteration"])
    return trainer.iteration


# ============================================================================ controller side
class _Pending:
    """An async save in flight: the thread that waits for the trainer ranks, then completes it."""

    def __init__(self, rollout_id: int, thread: threading.Thread, box: dict):
        self.rollout_id, self.thread, self.box = rollout_id, thread, box


# id(controller) -> (controller, the async save in flight)
_PENDING: dict[int, tuple[Any, _Pending]] = {}


def wait_for_pending_save(controller: Any) -> None:
    """Block until an async save of `controller` is complete (its marker written); raise if it failed."""
    entry = _PENDING.pop(id(controller), None)
    if entry is None:
        return
    pending = entry[1]
    pending.thread.join()
    if pending.box.get("error") is not None:
        raise CheckpointError(f"async checkpoint {pending.rollout_id} failed: {pending.box['error']}")


def _keep_limit(config: Any) -> Optional[int]:
    keep = _opt(config, "max_actor_ckpt_to_keep")
    if keep is None and _opt(config, "rotate_ckpt", False):
        keep = 1
    return int(keep) if keep else None


def _hf_path(config: Any, rollout_id: int) -> Optional[Path]:
    pattern = _opt(config, "save_hf")
    if not pattern:
        return None
    return Path(str(pattern).replace("{rollout_id}", str(rollout_id)))


def save_checkpoint(controller: Any, rollout_id: int) -> Path:
    """Save the run at `rollout_id` under --save (see the module docstring). Returns the iter_* path (with
    --async-save it appears once the background write is done)."""
    config = controller.config
    root = Path(config.save)
    root.mkdir(parents=True, exist_ok=True)
    wait_for_pending_save(controller)
    _remove_leftovers(root)
    path = iter_dir(root, rollout_id)
    staging = root / f".tmp_iter_{rollout_id:07d}"
    tmp = staging / path.name
    tmp.mkdir(parents=True)
    hf_final = _hf_path(config, rollout_id)
    hf_tmp = hf_final.with_name(hf_final.name + ".tmp") if hf_final is not None else None
    if hf_tmp is not None and hf_tmp.exists():
        shutil.rmtree(hf_tmp)
    last = rollout_id >= int(_opt(config, "num_rollout", 0) or 0)
    background = bool(_opt(config, "async_save", False)) and not last
    save_optim = not bool(_opt(config, "no_save_optim", False))
    t0 = time.perf_counter()
    infos = ray.get([w.__ray_call__.remote(_worker_save, str(tmp / "actor"), save_optim, background,
                                           str(hf_tmp) if hf_tmp is not None else None)
                     for w in controller.workers])
    aux = getattr(controller, "aux", None)
    if aux is not None:
        aux.save(str(tmp))
    rollout_state = ray.get(controller.rollout.state_dict.remote())
    meta = next(i["meta"] for i in infos if i["meta"] is not None)
    hf_parts = [i["hf"] for i in infos if i.get("hf")]

    def complete() -> None:
        if background:
            _wait_workers(controller.workers)
        _finish(root, rollout_id, tmp, path, staging, meta, rollout_state, config, hf_tmp, hf_final, hf_parts)
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
    _PENDING[id(controller)] = (controller, _Pending(rollout_id, thread, box))
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
    (tmp / "relax_state.json").write_text(json.dumps({"rollout_id": rollout_id, "rollout": rollout_state}))


def _finish(root: Path, rollout_id: int, tmp: Path, path: Path, staging: Path, meta: dict, rollout_state: Any,
            config: Any, hf_tmp: Optional[Path], hf_final: Optional[Path], hf_parts: list) -> None:
    """Every rank's files are written: complete the checkpoint, rename it into place, then mark it."""
    (tmp / "actor" / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    _write_rollout_state(tmp, rollout_id, rollout_state)
    old = root / f".old_iter_{rollout_id:07d}"
    if path.exists():  # the same iteration saved again (e.g. after --start-rollout-id): replace it
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(staging, ignore_errors=True)
    marker_tmp = root / "latest.tmp"
    marker_tmp.write_text(str(rollout_id))
    marker_tmp.replace(root / MARKER)
    shutil.rmtree(old, ignore_errors=True)
    if hf_tmp is not None:
        _finish_hf(config, hf_tmp, hf_final, hf_parts)
    keep = _keep_limit(config)
    if keep:
        rotate_checkpoints(root, keep)


def _finish_hf(config: Any, hf_tmp: Path, hf_final: Path, parts: list) -> None:
    """The ranks wrote the weights into `hf_tmp`: add config + tokenizer (and an index when the weights
    are split by pipeline stage), then rename it to `hf_final`."""
    from relax.weights.sync import copy_model_files

    source = _opt(config, "hf_checkpoint")
    hf_tmp.mkdir(parents=True, exist_ok=True)
    if source and Path(source).is_dir():
        copy_model_files(source, str(hf_tmp))
    elif source:
        from transformers import AutoConfig, AutoTokenizer

        AutoConfig.from_pretrained(source).save_pretrained(hf_tmp)
        AutoTokenizer.from_pretrained(source).save_pretrained(hf_tmp)
    if len(parts) > 1 or (parts and parts[0]["file"] != "model.safetensors"):
        weight_map = {n: p["file"] for p in parts for n in p["names"]}
        (hf_tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(p["bytes"] for p in parts)}, "weight_map": weight_map}, indent=1))
    if hf_final.exists():
        shutil.rmtree(hf_final)
    hf_tmp.rename(hf_final)
    logger.info("Hugging Face weights written to %s", hf_final)


def rotate_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete the oldest complete `iter_*` folders beyond `keep` (never the one the marker names)."""
    root = Path(root)
    marker = root / MARKER
    latest = int(marker.read_text().strip()) if marker.is_file() else None
    iters = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _ITER_RE.match(p.name)) and p.is_dir())
    removed = []
    for it, p in iters[:max(0, len(iters) - keep)]:
        if it == latest:
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    if removed:
        logger.info("removed old checkpoints: %s", ", ".join(p.name for p in removed))
    return removed


def _remove_leftovers(root: Path) -> None:
    """Staging folders of saves that never completed (a crash mid-save)."""
    for p in root.iterdir():
        if p.name.startswith((".tmp_iter_", ".old_iter_")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


# ============================================================================ resume
def latest_iteration(root: str | Path) -> Optional[int]:
    marker = Path(root) / MARKER
    return int(marker.read_text().strip()) if marker.is_file() else None


def resume_from(controller: Any, load: str) -> None:
    config = controller.config
    root = Path(load)
    rollout_id = latest_iteration(root)
    if rollout_id is None:
        logger.info("--load %s holds no checkpoint yet; starting from step 0", load)
        return
    path = iter_dir(root, rollout_id)
    actor = path / "actor"
    if not (actor / "meta.json").is_file():
        raise CheckpointError(f"--load {load}: {MARKER} names iteration {rollout_id} but {actor} is not a complete "
                              "checkpoint (meta.json is missing)")
    meta = json.loads((actor / "meta.json").read_text())
    no_load_optim = bool(_opt(config, "no_load_optim", False))
    if not meta.get("optimizer_saved", True) and not no_load_optim:
        raise CheckpointError(
            f"--load {load}: checkpoint {path.name} was saved with --no-save-optim and holds no optimizer state, "
            "so training cannot resume from it exactly. Add --no-load-optim to load its weights (and RNG) with a "
            "fresh optimizer, or resume from a checkpoint saved without --no-save-optim.")
    if no_load_optim:
        logger.warning("--no-load-optim: loading only the weights and RNG of %s; the optimizer and LR schedule "
                       "start fresh", path)
        ray.get([w.__ray_call__.remote(_worker_load_weights_only, str(actor)) for w in controller.workers])
    else:
        ray.get([w.load.remote(str(actor)) for w in controller.workers])
    aux = getattr(controller, "aux", None)
    if aux is not None:
        aux.load(str(path))
    state = json.loads((path / "relax_state.json").read_text())
    ray.get(controller.rollout.load_state_dict.remote(state["rollout"]))
    start = _opt(config, "start_rollout_id")
    controller.start_step = rollout_id if start is None else start
    if controller.engine_urls:
        ray.get([w.push_weights.remote(controller.engine_urls, rollout_id, config.update_weight_buffer_size)
                 for w in controller.workers])
    logger.info("resumed from %s at rollout step %d", path, controller.start_step)
