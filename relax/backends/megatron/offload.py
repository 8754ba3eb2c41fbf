"""Offload a `MegatronTrainer`'s memory while the rollout engines run (--offload-train / --colocate) and reload
it, byte for byte, before the next update.

What moves: every storage behind the model parameters (with Megatron's DDP also its contiguous param and grad
buffers, which `main_grad` views into), and behind the optimizer (Adam moments, fp32 main params of bf16/fp16
runs). Storages are found through the tensors and de-duplicated, so views stay valid: a storage is emptied in
place (`untyped_storage().resize_(0)`) and re-grown and refilled on reload, the way FSDP and verl free memory
without rebuilding the module or the optimizer.

- GPU (tensors on CUDA): each storage is copied into one pinned host buffer, freed, and `torch.cuda.empty_cache()`
  hands the memory back to the driver so the colocated engines can use it. (torch_memory_saver would need the
  trainer to allocate inside its region; the trainer does not, so the host copy is the path used.)
- CPU: the host copy would be no saving, so the bytes go to one spill file per rank (written straight from the
  tensor memory), the storages are freed and glibc is asked to return the freed pages (`malloc_trim`); the
  resident set size (RSS) before and after is measured and reported.

Grad buffers are saved as well (not only re-zeroed), so that whatever Megatron keeps in them survives.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Tensors of a Megatron optimizer (chained or not): its params (fp32 main copies) and Adam state."""
    if optimizer is None:
        return
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in chain:
        inner = getattr(opt, "optimizer", opt)
        for group in getattr(inner, "param_groups", []):
            for p in group["params"]:
                yield p
        for state in getattr(inner, "state", {}).values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value


def _model_tensors(trainer: Any) -> Iterator[torch.Tensor]:
    model = trainer.model
    for p in model.parameters():
        yield p
        grad = getattr(p, "main_grad", None)
        if isinstance(grad, torch.Tensor):
            yield grad
    for buffers in (getattr(model, "buffers", None), getattr(model, "expert_parallel_buffers", None)):
        for buf in buffers or []:
            for name in ("param_data", "grad_data"):
                t = getattr(buf, name, None)
                if isinstance(t, torch.Tensor):
                    yield t


def _host_buffer(storage: torch.UntypedStorage):
    """A writable buffer over a CPU storage's bytes, without copying."""
    return (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())


class TrainerOffloader:
    """`offload()` / `reload()` the storages of one trainer rank. Not thread-safe; one per rank."""

    def __init__(self, trainer: Any, spill_path: str | Path | None = None):
        self.trainer = trainer
        self.spill_path = Path(spill_path) if spill_path else None
        self.offloaded = False
        self.kept: list[torch.UntypedStorage] = []
        self._saved: list[tuple[torch.UntypedStorage, int, Any]] = []  # (storage, nbytes, host copy or offset)

    def _storages(self) -> list[torch.UntypedStorage]:
        seen: dict[tuple[str, int], torch.UntypedStorage] = {}
        for t in list(_model_tensors(self.trainer)) + list(_optimizer_tensors(getattr(self.trainer, "optimizer",
                                                                                        None))):
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue
            seen.setdefault((str(storage.device), storage.data_ptr()), storage)
        # storages over memory torch did not allocate (from_numpy, from_blob, mmap) cannot be freed in place
        self.kept = [s for s in seen.values() if not s.resizable()]
        return [s for s in seen.values() if s.resizable()]

    @staticmethod
    def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def offload(self) -> dict[str, float]:
        if self.offloaded:
            return {"offload/bytes": 0.0}
        t0 = time.perf_counter()
        rss_before = rss_bytes()
        storages = self._storages()
        on_gpu = any(s.device.type == "cuda" for s in storages)
        total = 0
        self._saved = []
        if on_gpu:
            for s in storages:
                n = s.nbytes()
                host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
                host.copy_(self._bytes_view(s), non_blocking=False)
                self._saved.append((s, n, host))
                s.resize_(0)
                total += n
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        else:
            if self.spill_path is None:
                raise RuntimeError("offloading a CPU trainer needs a spill file path")
            self.spill_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.spill_path, "wb") as fh:
                for s in storages:
                    n = s.nbytes()
                    fh.write(_host_buffer(s))  # no .numpy(): it would pin the storage's size for good
                    self._saved.append((s, n, total))
                    s.resize_(0)
                    total += n
            _malloc_trim()
        self.offloaded = True
        return {"offload/bytes": float(total), "offload/storages": float(len(storages)),
                "offload/kept_bytes": float(sum(s.nbytes() for s in self.kept)),
                "offload/rss_before": float(rss_before), "offload/rss_after": float(rss_bytes()),
                "offload/seconds": time.perf_counter() - t0,
                **({"offload/gpu_allocated_after": float(torch.cuda.memory_allocated())} if on_gpu else {})}

    def reload(self) -> dict[str, float]:
        if not self.offloaded:
            return {"reload/bytes": 0.0}
        t0 = time.perf_counter()
        total = 0
        fh = None
        try:
            for s, n, where in self._saved:
                s.resize_(n)
                if isinstance(where, torch.Tensor):
                    self._bytes_view(s).copy_(where, non_blocking=False)
                else:
                    if fh is None:
                        fh = open(self.spill_path, "rb")
                    fh.seek(where)
                    if fh.readinto(_host_buffer(s)) != n:
                        raise RuntimeError(f"offload spill file {self.spill_path} is truncated")
                total += n
        finally:
            if fh is not None:
                fh.close()
        if any(isinstance(w, torch.Tensor) for _, _, w in self._saved):
            torch.cuda.synchronize()
        self._saved = []
        self.offloaded = False
        if self.spill_path is not None and self.spill_path.exists():
            self.spill_path.unlink()
        return {"reload/bytes": float(total), "reload/rss_after": float(rss_bytes()),
                "reload/seconds": time.perf_counter() - t0}
