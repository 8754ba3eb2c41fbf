"""Save and restore a Megatron trainer's state: model, optimizer, scheduler and RNG, atomically.

File names, folders and the save-root protocol are in `relax.formats.checkpoint_layout`; this
module writes and reads the files themselves (all ranks must see the same filesystem). Resuming needs
the same parallel layout (tp, pp, ep, dp, world size).

Two savers share one writer (`snapshot_rank` / `rank_state` -> `write_rank`, `checkpoint_meta`):
- `save_checkpoint`: collective and synchronous, into `<dir>.tmp`, renamed into place once every rank is
  done (a role saving its own folder, e.g. the critic or a refreshed reference);
- the run checkpoint (`relax.core.checkpointing`): each rank snapshots its state to CPU memory with
  `snapshot_rank` and writes it now or from a background thread (--async-save); the controller writes
  meta.json once every rank is done.
"""

from __future__ import annotations

import copy
import json
import pickle
import random
import shutil
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from relax.formats.checkpoint_layout import (
    FORMAT,
    SCHEDULER_FILE,
    is_relax_checkpoint,
    rank_file,
    read_meta,
    resolve_model_checkpoint,
    write_meta,
)
from relax.backends.megatron.cpu_compat import apply_cpu_compat
from relax.backends.megatron.hf_weights import unwrap_model
from relax.backends.megatron.lora import checkpoint_state, load_checkpoint_state
from relax.backends.megatron.lora_peft import ADAPTER_FILE, peft_snapshot, write_config
from relax.backends.megatron.megatron_options import option
from relax.backends.megatron.parallel import ParallelLayout
from relax.weights.sync import _unshared, copy_model_files

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
    "optimizer_state",
    "set_optimizer_state",
    "load_model_state",
    "load_weights_only",
    "is_relax_checkpoint",
    "resolve_model_checkpoint",
    "load_state_file",
    "cpu_copy",
    "RankSnapshot",
    "snapshot_rank",
    "write_rank",
    "checkpoint_meta",
    "finish_hf_folder",
]



def _numpy_state_to_safe(state: tuple) -> tuple:
    kind, keys, pos, has_gauss, cached = state
    return (str(kind), torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))


def _numpy_state_from_safe(state: tuple) -> tuple:
    kind, keys, pos, has_gauss, cached = state
    if isinstance(keys, torch.Tensor):
        keys = keys.numpy().astype(np.uint32)
    return (kind, keys, pos, has_gauss, cached)


def _numpy_safe_globals() -> list:
    """NumPy's array reconstructors: data only, found in the RNG state of checkpoints written before the
    RNG state was stored as a tensor; allowed so that those still load with weights_only=True."""
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_state_file(path: str | Path, iteration: Optional[int] = None) -> Any:
    """`torch.load` of one checkpoint file with `weights_only=True`: tensors, numbers, strings and
    containers load; a file that would run code is refused. Errors name the file and the iteration."""
    path = Path(path)
    where = f"{path}" + (f" (iteration {iteration})" if iteration is not None else "")
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint file {where} is missing") from None
    except pickle.UnpicklingError as exc:
        raise ValueError(f"checkpoint file {where} holds objects other than tensors and plain values and was "
                         f"not loaded (it could run code): {str(exc).splitlines()[0]}") from None
    except RuntimeError as exc:
        raise ValueError(f"checkpoint file {where} is damaged or truncated ({str(exc).splitlines()[0]})") from None


def rng_state() -> dict[str, Any]:
    """Every random state this rank uses (Python, NumPy, torch CPU/CUDA, Megatron tracker)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state: dict[str, Any] = {
        "python": random.getstate(),
        # As plain values and a tensor, so that the file loads with weights_only=True.
        "numpy": _numpy_state_to_safe(np.random.get_state()),
        "torch_cpu": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(_numpy_state_from_safe(state["numpy"]))
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_state(optimizer) -> list[Optional[dict[str, Any]]]:
    """This rank's optimizer state, for any Megatron optimizer type.

    Per sub-optimizer: the inner torch optimizer's state dict, the values of the
    parameters it updates (fp32 main params, or this rank's shard of them with
    the distributed optimizer) and the loss-scaler state.
    """
    states: list[Optional[dict[str, Any]]] = []
    for sub in _sub_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        if inner is None or getattr(sub, "is_stub_optimizer", False):
            states.append(None)
            continue
        entry: dict[str, Any] = {
            "inner": inner.state_dict(),
            "main_params": [p.detach().clone() for g in inner.param_groups for p in g["params"]],
        }
        if getattr(sub, "grad_scaler", None) is not None:
            entry["grad_scaler"] = sub.grad_scaler.state_dict()
        states.append(entry)
    return states


def set_optimizer_state(optimizer, states: list[Optional[dict[str, Any]]]) -> None:
    """Inverse of `optimizer_state` (same parallel layout required)."""
    subs = _sub_optimizers(optimizer)
    if len(subs) != len(states):
        raise ValueError(f"checkpoint has {len(states)} optimizers, model has {len(subs)}")
    for sub, entry in zip(subs, states):
        if entry is None:
            continue
        inner = sub.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        if len(params) != len(entry["main_params"]):
            raise ValueError("optimizer parameter count differs from the checkpoint")
        for param, value in zip(params, entry["main_params"]):
            if param.shape != value.shape:
                raise ValueError(f"optimizer parameter shape {tuple(param.shape)} != {tuple(value.shape)}")
            param.copy_(value)
        inner.load_state_dict(entry["inner"])
        if "grad_scaler" in entry:
            sub.grad_scaler.load_state_dict(entry["grad_scaler"])


def _layout_key(layout: ParallelLayout) -> dict[str, int]:
    return {k: getattr(layout, k) for k in ("world_size", "tp", "pp", "cp", "ep", "dp")}


def _check_meta(meta: dict[str, Any], layout: ParallelLayout, hint: str = "") -> None:
    if meta.get("format") != FORMAT:
        raise ValueError(f"unknown checkpoint format {meta.get('format')}")
    if meta["layout"] != _layout_key(layout):
        raise ValueError(f"checkpoint layout {meta['layout']} != current {_layout_key(layout)}{hint}")


# ============================================================================ writing
def cpu_copy(obj: Any) -> Any:
    """A deep copy with every tensor cloned to CPU memory (a snapshot training cannot change)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = cpu_copy(v)
        if hasattr(obj, "_metadata"):  # nn.Module.state_dict's version info
            out._metadata = copy.deepcopy(obj._metadata)
        return out
    if isinstance(obj, list):
        return [cpu_copy(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".part")
    torch.save(obj, tmp)
    tmp.replace(path)


def rank_state(model, optimizer, save_rng: bool = True) -> dict[str, Any]:
    """What a rank's file holds: its model shard, optimizer state (None without one) and RNG (None with
    --no-save-rng)."""
    return {"model": checkpoint_state(unwrap_model(model)),  # with LoRA the adapters only
            "optimizer": optimizer_state(optimizer) if optimizer is not None else None,
            "rng": rng_state() if save_rng else None}


def restore_rng(state: dict[str, Any], path: Path, load_rng: bool = True) -> None:
    """Set the RNG state a rank's file holds; --no-load-rng (`load_rng=False`) keeps the current one. A checkpoint
    saved with --no-save-rng has none, and loading it asks for --no-load-rng, as Megatron-LM does."""
    if not load_rng:
        return
    if state.get("rng") is None:
        raise ValueError(f"{path} holds no RNG state (saved with --no-save-rng); load it with --no-load-rng")
    set_rng_state(state["rng"])


def checkpoint_meta(iteration: int, layout: ParallelLayout, extra_meta: dict[str, Any] | None = None) -> dict:
    return {"format": FORMAT, "iteration": iteration, "layout": _layout_key(layout), **(extra_meta or {})}


@dataclass
class RankSnapshot:
    """One rank's part of a checkpoint, in CPU memory: what `write_rank` puts on disk."""

    rank: int
    state: dict[str, Any]
    scheduler: Optional[dict[str, Any]] = None  # rank 0
    meta: Optional[dict[str, Any]] = None  # rank 0; written by whoever completes the checkpoint
    hf_file: Optional[str] = None  # this pipeline stage's HF safetensors file (one writer per stage)
    hf_tensors: Optional[list[tuple[str, torch.Tensor]]] = None
    adapter_config: Optional[dict[str, Any]] = None  # with LoRA: the HF folder is a PEFT adapter (lora_peft)

    def hf_part(self) -> Optional[dict[str, Any]]:
        """What `finish_hf_folder` needs to know of this rank's HF file (None when it writes none)."""
        if not self.hf_tensors:
            return None
        return {"file": self.hf_file, "names": [n for n, _ in self.hf_tensors],
                "bytes": sum(t.numel() * t.element_size() for _, t in self.hf_tensors),
                **({"adapter_config": self.adapter_config} if self.adapter_config else {})}


@torch.no_grad()
def snapshot_rank(trainer: Any, *, save_optim: bool, hf: bool = False) -> RankSnapshot:
    """A CPU copy of this rank's state of a `MegatronTrainer` (and with `hf`, its HF weights: collective
    over all ranks)."""
    apply_cpu_compat()
    rank = dist.get_rank()
    optimizer = trainer.optimizer if save_optim else None
    save_rng = not option(trainer.settings.megatron_options, "no_save_rng", False)
    snap = RankSnapshot(rank=rank, state=cpu_copy(rank_state(trainer.model, optimizer, save_rng)))
    if rank == 0:
        if trainer.scheduler is not None:
            snap.scheduler = cpu_copy(trainer.scheduler.state_dict())
        snap.meta = checkpoint_meta(trainer.iteration, trainer.layout, {
            "arch": asdict(trainer.arch), "settings": asdict(trainer.settings),
            "optimizer_saved": optimizer is not None})
    if hf:
        from megatron.core import parallel_state as ps  # megatron-core loads after apply_cpu_compat

        if trainer.settings.lora is not None:  # the adapters, as PEFT writes them (one file: a single stage)
            named, snap.adapter_config = peft_snapshot(trainer)
        else:
            named = [(n, t.detach().to("cpu", copy=True).contiguous()) for n, t in trainer.export_hf_weights()]
        if (ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0):
            pp, stage = trainer.layout.pp, ps.get_pipeline_model_parallel_rank()
            snap.hf_file = "model.safetensors" if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"
            snap.hf_file = ADAPTER_FILE if snap.adapter_config else snap.hf_file
            snap.hf_tensors = named
    return snap


def write_rank(snap: RankSnapshot, folder: str | Path, hf_dir: str | Path | None = None) -> None:
    """This rank's files under `folder` (each written whole, then renamed); its HF file under `hf_dir`."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_torch_save(snap.state, out / rank_file(snap.rank))
    if snap.scheduler is not None:
        _atomic_torch_save(snap.scheduler, out / SCHEDULER_FILE)
    if snap.hf_tensors and hf_dir is not None:
        Path(hf_dir).mkdir(parents=True, exist_ok=True)
        save_file(_unshared(dict(snap.hf_tensors)), str(Path(hf_dir) / snap.hf_file), metadata={"format": "pt"})


def finish_hf_folder(folder: Path, parts: list[dict[str, Any]], source: Optional[str]) -> None:
    """The ranks wrote their HF weight files into `folder`: add the config and tokenizer files of the
    model folder `source` (--hf-checkpoint, a local folder: checked before the run starts) and, when the
    weights are split by pipeline stage, the index."""
    folder.mkdir(parents=True, exist_ok=True)
    adapter = next((p["adapter_config"] for p in parts if p.get("adapter_config")), None)
    if adapter is not None:  # a PEFT adapter of the base --hf-checkpoint: its config, not the model's files
        write_config(folder, {**adapter, "base_model_name_or_path": source})
        return
    if source:
        copy_model_files(source, str(folder))
    if len(parts) > 1 or (parts and parts[0]["file"] != "model.safetensors"):
        weight_map = {n: p["file"] for p in parts for n in p["names"]}
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(p["bytes"] for p in parts)}, "weight_map": weight_map}, indent=1))


@torch.no_grad()
def save_checkpoint(
    path: str | Path,
    *,
    model,
    optimizer,
    scheduler,
    iteration: int,
    layout: ParallelLayout,
    extra_meta: dict[str, Any] | None = None,
    save_rng: bool = True,
) -> Path:
    """Write a checkpoint to `path` (collective over all ranks); `optimizer`/`scheduler` may be None
    (a forward-only model); `save_rng=False`: --no-save-rng."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    snap = RankSnapshot(rank=rank, state=rank_state(model, optimizer, save_rng),
                        scheduler=scheduler.state_dict() if rank == 0 and scheduler is not None else None)
    write_rank(snap, tmp)
    dist.barrier()
    if rank == 0:
        write_meta(tmp, checkpoint_meta(iteration, layout, extra_meta))
        old = path.with_name(path.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()
    return path


# ============================================================================ reading
@torch.no_grad()  # Megatron copies into views of parameters
def load_checkpoint(path: str | Path, *, model, optimizer, scheduler, layout: ParallelLayout,
                    load_rng: bool = True) -> int:
    """Restore a checkpoint written by `save_checkpoint`; returns its iteration. `load_rng=False`: --no-load-rng."""
    path = Path(path)
    meta = read_meta(path)
    _check_meta(meta, layout)
    rank = dist.get_rank()
    state = load_state_file(path / rank_file(rank), meta.get("iteration"))
    load_checkpoint_state(unwrap_model(model), state["model"])
    if optimizer is not None:
        if state.get("optimizer") is None:
            raise ValueError(f"{path} holds no optimizer state (a forward-only model); load it with load_model_state")
        set_optimizer_state(optimizer, state["optimizer"])
    if scheduler is not None:
        # Megatron's scheduler adds the saved step count to its current one.
        scheduler.num_steps = 0
        scheduler.load_state_dict(load_state_file(path / SCHEDULER_FILE, meta.get("iteration")))
    restore_rng(state, path, load_rng)
    dist.barrier()
    return int(meta["iteration"])


@torch.no_grad()
def load_model_state(path: str | Path, *, model, layout: ParallelLayout) -> int:
    """Load only the model weights of a checkpoint written by `save_checkpoint` (same layout)."""
    path = Path(path)
    meta = read_meta(path)
    _check_meta(meta, layout, "; a model checkpoint loads only into the parallel layout that wrote it")
    state = load_state_file(path / rank_file(dist.get_rank()), meta.get("iteration"))
    load_checkpoint_state(unwrap_model(model), state["model"])
    return int(meta["iteration"])


def load_weights_only(trainer: Any, path: str | Path) -> int:
    """--no-load-optim: the model weights and RNG of a checkpoint into a `MegatronTrainer`, whose optimizer
    and scheduler start fresh; returns (and sets) the checkpoint's iteration."""
    path = Path(path)
    trainer.load_weights(str(path))
    meta = read_meta(path)
    state = load_state_file(path / rank_file(dist.get_rank()), meta.get("iteration"))
    restore_rng(state, path, not option(trainer.settings.megatron_options, "no_load_rng", False))
    trainer.iteration = int(meta["iteration"])
    return trainer.iteration
