"""Weight updates from a sender's shared-memory segment (`relax.weights.shm`), run on the scheduler thread.

Two formats of `/update_weights_from_tensor`:

- `relax_shm` (`apply_ranges`): pieces of tensors are copied from the segment into the parameters.
- `relax_shm_bind` (`bind`, the one-copy weight sync): whole tensors; a parameter whose dtype and shape
  match is pointed at its view of the segment (`param.data = view`, no copy), anything else (a buffer,
  an alias view of fused experts, a parameter the engine keeps in another dtype) is copied from it.
  The sender writes the half of its double-buffered segment that this engine is not using, and the
  rebinding happens between two decode steps like every update, so a running request never reads a
  tensor that is being written.

Parameters that are views of a sender's segment must never be written in place (other engines and the
sender's next push share those pages): every other kind of update first gives them private storage
again (`privatize`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable

import torch

from relax.backends.embedded.requests import EngineError

if TYPE_CHECKING:  # pragma: no cover
    from relax.backends.embedded.engine import EmbeddedEngine

Piece = tuple[str, tuple, int, torch.Tensor]  # (hf name, full shape, start element, 1-D source view)


def _bound_storages(engine: "EmbeddedEngine") -> set[int]:
    """Base addresses of the segment mappings that parameters of `engine` were pointed into."""
    return engine.__dict__.setdefault("_bound_storages", set())


def privatize(engine: "EmbeddedEngine") -> int:
    """Give every parameter that lives in a sender's segment its own memory again (a copy); returns how
    many. Called before any update that writes parameters in place."""
    bases = _bound_storages(engine)
    if not bases:
        return 0
    n = 0
    with torch.no_grad():
        for p in engine.model.parameters():
            if p.numel() and p.untyped_storage().data_ptr() in bases:
                p.data = p.data.clone()
                n += 1
    bases.clear()
    return n


def bound_parameters(engine: "EmbeddedEngine") -> list[str]:
    """Names of the parameters that are views of a sender's segment now (for tests and server info)."""
    bases = _bound_storages(engine)
    return [n for n, p in engine.model.named_parameters()
            if p.numel() and p.untyped_storage().data_ptr() in bases]


def dtype_exceptions(engine: "EmbeddedEngine") -> dict[str, str]:
    """Floating parameters the engine keeps in a dtype other than its own (the sender casts everything
    else to the engine's dtype so that it can be bound)."""
    return {n: str(p.dtype).replace("torch.", "") for n, p in engine.model.named_parameters()
            if p.is_floating_point() and p.dtype != engine.dtype}


def _reject(unknown: list, bad: list) -> None:
    if unknown or bad:
        msg = [f"unknown parameter names {unknown[:8]}{' ...' if len(unknown) > 8 else ''}"] if unknown else []
        msg += [f"shape mismatch {bad[:8]}"] if bad else []
        raise EngineError("weight update rejected, nothing changed: " + "; ".join(msg))


def _refuse_if_offloaded(engine: "EmbeddedEngine") -> None:
    if engine.released and engine.offload_weights_on_release and engine._weights_offloaded:
        raise EngineError("weights are released; resume_memory_occupation first", status=400)


def apply_ranges(engine: "EmbeddedEngine", pieces: Iterable[Piece], weight_version: str | None) -> dict:
    """`relax_shm`: copy each piece into elements [start, start + numel) of the row-major parameter; all
    pieces are checked before any is copied."""
    _refuse_if_offloaded(engine)
    privatize(engine)
    targets = engine._named_targets()
    unknown, bad, plan = [], [], []
    for name, shape, start, src in pieces:
        dst = targets.get(name)
        if dst is None:
            if not engine._ignorable(name):
                unknown.append(name)
            continue
        if tuple(dst.shape) != tuple(shape) and dst.numel() != 0:
            bad.append(f"{name}: engine {tuple(dst.shape)} vs update {tuple(shape)}")
        elif start + src.numel() > dst.numel() or not dst.is_contiguous():
            bad.append(f"{name}: elements [{start}, {start + src.numel()}) of {dst.numel()} "
                       f"({'contiguous' if dst.is_contiguous() else 'not contiguous'})")
        else:
            plan.append((name, dst.view(-1)[start:start + src.numel()], src))
    _reject(unknown, bad)
    return engine._apply_plan(plan, weight_version)


def _bind_plan(engine: "EmbeddedEngine", pieces: Iterable[Piece]):
    params = dict(engine.model.named_parameters(remove_duplicate=False))
    targets = engine._named_targets()
    unknown, bad, binds, copies = [], [], [], []
    for name, shape, start, src in pieces:
        dst = targets.get(name)
        if dst is None:
            if not engine._ignorable(name):
                unknown.append(name)
            continue
        shape = tuple(shape)
        if tuple(dst.shape) != shape and dst.numel() != 0:
            bad.append(f"{name}: engine {tuple(dst.shape)} vs update {shape}")
        elif start != 0 or src.numel() != torch.Size(shape).numel():
            bad.append(f"{name}: {src.numel()} elements from {start}, not the whole tensor of {shape}")
        elif name in params and dst.dtype == src.dtype and dst.device == src.device:
            binds.append((params[name], src.view(shape)))
        else:
            copies.append((name, dst, src.view(shape)))
    _reject(unknown, bad)
    return binds, copies


def bind(engine: "EmbeddedEngine", pieces: list[Piece], weight_version: str | None, segment: torch.Tensor) -> dict:
    """`relax_shm_bind`: point the parameters at their views of `segment` (copy what cannot be bound),
    then take `weight_version`. Checked in full first: a rejected update changes nothing."""
    _refuse_if_offloaded(engine)
    binds, copies = _bind_plan(engine, pieces)
    bases = _bound_storages(engine)
    if any(dst.numel() and dst.untyped_storage().data_ptr() in bases for _, dst, _ in copies):
        # a copy would land in pages of a sender's segment (e.g. an alias view of a bound parameter): give
        # the bound parameters private memory first, then plan again on the new storage. Copies into
        # private tensors (fused MoE experts, buffers, another dtype) need not, push after push.
        privatize(engine)
        binds, copies = _bind_plan(engine, pieces)
    t0 = time.perf_counter()
    base = segment.untyped_storage().data_ptr()
    with torch.no_grad():
        for p, view in binds:
            p.data = view
        if binds:
            # keep the bases that parameters still point into (an older segment stays alive through them)
            live = {p.untyped_storage().data_ptr() for p in engine.model.parameters() if p.numel()}
            bases.intersection_update(live)
            bases.add(base)
    res = engine._apply_plan(copies, weight_version)
    res.update(num_tensors=len(binds) + len(copies), bound=len(binds), copied=len(copies),
               apply_s=time.perf_counter() - t0)
    engine.stats["last_weight_update_s"] = res["apply_s"]
    return res


def server_info(engine: "EmbeddedEngine") -> dict[str, Any]:
    return {"weight_dtype_exceptions": dtype_exceptions(engine)}
