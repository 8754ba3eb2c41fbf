"""Save and restore model, optimizer, scheduler and RNG state, atomically.

Layout of a checkpoint folder (all ranks must see the same filesystem):

    meta.json                 iteration, parallel layout, arch (written last)
    scheduler.pt              OptimizerParamScheduler state (same on all ranks)
    rank{R:05d}.pt            per global rank: model shard, optimizer state, RNG

Writes go to `<dir>.tmp` and are renamed into place once every rank is done,
so a crash never leaves a half-written `<dir>`. Resuming needs the same
parallel layout (tp, pp, ep, dp, world size).
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from relax.backends.megatron.hf_weights import unwrap_model
from relax.backends.megatron.parallel import ParallelLayout

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
    "optimizer_state",
    "set_optimizer_state",
    "load_model_state",
    "is_relax_checkpoint",
    "resolve_model_checkpoint",
    "load_state_file",
]

_FORMAT = 1


def _numpy_state_to_safe(state: tuple) -> tuple:
    kind, keys, pos, has_gauss, cached = state
    return (str(kind), torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))


def _numpy_state_from_safe(state: tuple) -> tuple:
    import numpy as np

    kind, keys, pos, has_gauss, cached = state
    if isinstance(keys, torch.Tensor):
        keys = keys.numpy().astype(np.uint32)
    return (kind, keys, pos, has_gauss, cached)


def _numpy_safe_globals() -> list:
    """NumPy's array reconstructors: data only, found in the RNG state of checkpoints written before the
    RNG state was stored as a tensor; allowed so that those still load with weights_only=True."""
    import numpy as np

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
    import numpy as np
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
    import numpy as np
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
) -> Path:
    """Write a checkpoint to `path` (collective over all ranks); `optimizer`/`scheduler` may be None
    (a forward-only model)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()

    torch.save(
        {
            "model": unwrap_model(model).state_dict(),
            "optimizer": optimizer_state(optimizer) if optimizer is not None else None,
            "rng": rng_state(),
        },
        tmp / f"rank{rank:05d}.pt",
    )
    if rank == 0 and scheduler is not None:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    dist.barrier()
    if rank == 0:
        meta = {
            "format": _FORMAT,
            "iteration": iteration,
            "layout": _layout_key(layout),
            **(extra_meta or {}),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
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


@torch.no_grad()  # Megatron copies into views of parameters
def load_checkpoint(path: str | Path, *, model, optimizer, scheduler, layout: ParallelLayout) -> int:
    """Restore a checkpoint written by `save_checkpoint`; returns its iteration."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format") != _FORMAT:
        raise ValueError(f"unknown checkpoint format {meta.get('format')}")
    if meta["layout"] != _layout_key(layout):
        raise ValueError(f"checkpoint layout {meta['layout']} != current {_layout_key(layout)}")
    rank = dist.get_rank()
    state = load_state_file(path / f"rank{rank:05d}.pt", meta.get("iteration"))
    unwrap_model(model).load_state_dict(state["model"], strict=True)
    if optimizer is not None:
        if state.get("optimizer") is None:
            raise ValueError(f"{path} holds no optimizer state (a forward-only model); load it with load_model_state")
        set_optimizer_state(optimizer, state["optimizer"])
    if scheduler is not None:
        # Megatron's scheduler adds the saved step count to its current one.
        scheduler.num_steps = 0
        scheduler.load_state_dict(load_state_file(path / "scheduler.pt", meta.get("iteration")))
    set_rng_state(state["rng"])
    dist.barrier()
    return int(meta["iteration"])


def is_relax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / "meta.json").is_file() and (Path(path) / "rank00000.pt").is_file()


def resolve_model_checkpoint(path: str | Path, step: Optional[int] = None, role: str = "actor") -> tuple[str, Path]:
    """Where a model's weights are: ("relax", dir written by save_checkpoint) or ("hf", HF folder).

    Accepts a checkpoint dir itself, a Relax save root (`latest_checkpointed_iteration.txt`,
    `iter_XXXXXXX/<role>`; `step` picks an iteration, default the latest), one `iter_XXXXXXX` dir, or an
    HF model folder (`config.json`).
    """
    p = Path(path)
    if is_relax_checkpoint(p):
        return "relax", p
    marker = p / "latest_checkpointed_iteration.txt"
    if step is not None or marker.is_file():
        it = step if step is not None else int(marker.read_text().strip())
        candidate = p / f"iter_{it:07d}" / role
        if is_relax_checkpoint(candidate):
            return "relax", candidate
        raise FileNotFoundError(f"{p}: no {role} checkpoint for iteration {it} ({candidate} is missing)")
    if is_relax_checkpoint(p / role):
        return "relax", p / role
    if (p / "config.json").is_file():
        return "hf", p
    raise FileNotFoundError(f"{p} is neither a Relax checkpoint (meta.json), a save root "
                            "(latest_checkpointed_iteration.txt) nor a Hugging Face model folder (config.json)")


@torch.no_grad()
def load_model_state(path: str | Path, *, model, layout: ParallelLayout) -> int:
    """Load only the model weights of a checkpoint written by `save_checkpoint` (same layout)."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format") != _FORMAT:
        raise ValueError(f"unknown checkpoint format {meta.get('format')}")
    if meta["layout"] != _layout_key(layout):
        raise ValueError(f"checkpoint layout {meta['layout']} != current {_layout_key(layout)}; "
                         "a model checkpoint loads only into the parallel layout that wrote it")
    state = load_state_file(path / f"rank{dist.get_rank():05d}.pt", meta.get("iteration"))
    unwrap_model(model).load_state_dict(state["model"], strict=True)
    return int(meta["iteration"])
