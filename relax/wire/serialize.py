"""Serialization of named tensors for SGLang's `/update_weights_from_tensor` payload.

Wire format (what real SGLang and the embedded engine both accept):

- Each entry of `serialized_named_tensors` is `base64(ForkingPickler.dumps(obj))`, a str.
  ForkingPickler is `torch.multiprocessing`'s pickler: with the "file_system" sharing strategy a
  CPU tensor travels as the *name* of a shared-memory file (its data is moved into /dev/shm), so
  the HTTP body stays tiny and the receiving process on the same host maps the same memory.
  The sender must keep the tensors alive until the request has been answered.
- `load_format=None`: `obj` is a list of `(hf_name, tensor)`.
- `load_format="flattened_bucket"`: `obj` is `{"flattened_tensor": 1-D tensor, "metadata": [m]}`
  where each `m` has attributes `name, shape, dtype, start_idx, end_idx, numel` (element offsets
  into the flat tensor). We build `m` as `types.SimpleNamespace`, which SGLang's restricted
  unpickler allows and which needs no SGLang import on either side. All tensors of one bucket
  share one dtype (`iter_buckets(..., group_by_dtype=True)`), so both the older SGLang reader
  (`flat[start:end].to(dtype)`) and the newer one (`flat[start:end].view(dtype)`) rebuild them.
- SGLang reads `serialized_named_tensors[tp_rank]`: one entry per tensor-parallel rank of the
  server, i.e. the same string repeated `tp_size` times (`payload_entries`).

Chunking: `iter_buckets(named_tensors, buffer_bytes)` yields lists whose total size stays within
`buffer_bytes` (a tensor larger than the buffer travels alone).

Deserialization (`deserialize_named_tensors`) uses a restricted unpickler: an exact allow-list of
(module, name) pairs (tensor rebuilders, storages, dtypes, `torch.Size`, the metadata classes) and
nothing else; names are never resolved through attributes.
"""

from __future__ import annotations

import base64
import importlib
import io
import pickle
import threading
import types
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Sequence, Tuple

import torch

NamedTensors = List[Tuple[str, torch.Tensor]]

LOAD_FORMATS = (None, "flattened_bucket")


def ensure_file_system_sharing() -> None:
    """Use torch's "file_system" sharing strategy in this process (needed by both ends).

    The default "file_descriptor" strategy passes fds over a Unix socket that only works between
    a parent and its multiprocessing children; across unrelated processes (trainer -> engine
    server) it fails. This is a process-wide setting.
    """
    import torch.multiprocessing as mp

    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(
    named_tensors: Iterable[Tuple[str, torch.Tensor]],
    buffer_bytes: int,
    *,
    group_by_dtype: bool = False,
) -> Iterator[NamedTensors]:
    """Split `named_tensors` into consecutive lists of at most `buffer_bytes` bytes each.

    A single tensor larger than `buffer_bytes` forms a bucket of its own. With
    `group_by_dtype`, a bucket is also closed whenever the dtype changes (one open bucket per
    dtype is kept, so interleaved dtypes do not fragment buckets); order within a dtype is kept.
    """
    if buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
    open_buckets: dict[Any, tuple[NamedTensors, int]] = {}
    for name, tensor in named_tensors:
        key = tensor.dtype if group_by_dtype else None
        bucket, size = open_buckets.get(key, ([], 0))
        nbytes = tensor_nbytes(tensor)
        if bucket and size + nbytes > buffer_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
        open_buckets[key] = (bucket, size)
    for bucket, _ in open_buckets.values():
        if bucket:
            yield bucket


def _cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


class SharedBufferPool:
    """Reusable shared-memory staging buffers, one growing 1-D tensor per dtype.

    Copying a bucket into an already shared buffer costs one memcpy; without a pool every update
    allocates fresh shared memory (page faults) and copies twice (concatenate, then move into
    /dev/shm). A buffer may be overwritten as soon as the engine has answered the request that
    used it, so a pool must serve one update at a time (EngineClient holds a lock).
    """

    def __init__(self):
        self._bufs: dict[torch.dtype, torch.Tensor] = {}
        self.lock = threading.Lock()  # held by a sender for a whole update

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._bufs.get(dtype)
        if buf is None or buf.numel() < numel:
            ensure_file_system_sharing()
            self._bufs.pop(dtype, None)
            buf = torch.empty(max(1, numel), dtype=dtype).share_memory_()
            self._bufs[dtype] = buf
        return buf[:numel]

    def nbytes(self) -> int:
        return sum(tensor_nbytes(b) for b in self._bufs.values())

    def clear(self) -> None:
        self._bufs.clear()


def flatten_bucket(named_tensors: Sequence[Tuple[str, torch.Tensor]], pool: SharedBufferPool | None = None) -> dict:
    """`{"flattened_tensor", "metadata"}` for tensors that all share one dtype."""
    if not named_tensors:
        raise ValueError("cannot flatten an empty bucket")
    dtypes = {t.dtype for _, t in named_tensors}
    if len(dtypes) != 1:
        raise ValueError(f"a flattened bucket needs one dtype, got {sorted(map(str, dtypes))}")
    total = sum(t.numel() for _, t in named_tensors)
    flat = pool.take(next(iter(dtypes)), total) if pool is not None else None
    flats, metadata, offset = [], [], 0
    for name, t in named_tensors:
        t = _cpu_contiguous(t)
        n = t.numel()
        if flat is not None:
            flat[offset:offset + n].copy_(t.reshape(-1))
        else:
            flats.append(t.reshape(-1))
        metadata.append(
            types.SimpleNamespace(
                name=name, shape=t.shape, dtype=t.dtype, start_idx=offset, end_idx=offset + n, numel=n
            )
        )
        offset += n
    return {"flattened_tensor": flat if flat is not None else torch.cat(flats, dim=0), "metadata": metadata}


def _pooled_copies(named_tensors: Sequence[Tuple[str, torch.Tensor]], pool: SharedBufferPool) -> NamedTensors:
    totals: dict[torch.dtype, int] = {}
    for _, t in named_tensors:
        totals[t.dtype] = totals.get(t.dtype, 0) + t.numel()
    bufs = {dt: pool.take(dt, n) for dt, n in totals.items()}
    offsets = dict.fromkeys(totals, 0)
    out: NamedTensors = []
    for name, t in named_tensors:
        t = _cpu_contiguous(t)
        off, n = offsets[t.dtype], t.numel()
        view = bufs[t.dtype][off:off + n]
        view.copy_(t.reshape(-1))
        out.append((name, view.view(t.shape)))
        offsets[t.dtype] = off + n
    return out


def forking_dumps(obj: Any) -> bytes:
    from multiprocessing.reduction import ForkingPickler

    ensure_file_system_sharing()
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def serialize_named_tensors(
    named_tensors: Sequence[Tuple[str, torch.Tensor]],
    load_format: str | None = "flattened_bucket",
    *,
    copy: bool = True,
    pool: SharedBufferPool | None = None,
) -> tuple[str, list]:
    """Serialize one bucket; return `(base64 str, keepalive)`.

    `keepalive` holds the tensors whose shared memory the string points to: keep it referenced
    until the engine has answered. With `pool`, tensors are staged in its reusable shared
    buffers. Without one, flattened buckets are a fresh concatenation and with `load_format=None`
    and `copy=True` the tensors are cloned first, because pickling moves a tensor's storage into
    shared memory in place (the caller's own tensors, e.g. live parameters, would otherwise be
    rehomed to /dev/shm).
    """
    if load_format == "flattened_bucket":
        obj = flatten_bucket(named_tensors, pool)
        keepalive = [obj["flattened_tensor"]]
    elif load_format is None:
        if pool is not None:
            obj = _pooled_copies(named_tensors, pool)
        else:
            obj = [(name, _cpu_contiguous(t).clone() if copy else _cpu_contiguous(t)) for name, t in named_tensors]
        keepalive = [t for _, t in obj]
    else:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {LOAD_FORMATS}")
    return base64.b64encode(forking_dumps(obj)).decode("ascii"), keepalive


def payload_entries(serialized: str, tp_size: int = 1) -> list[str]:
    """`serialized_named_tensors` for a server with `tp_size` ranks (SGLang reads entry tp_rank)."""
    return [serialized] * max(1, int(tp_size))


# ---------------------------------------------------------------------------------------------
# Receiving side
# ---------------------------------------------------------------------------------------------


@dataclass
class FlatMeta:
    """Stand-in for SGLang's FlattenedTensorMetadata when a payload names that class."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


def _torch_dtype_names() -> frozenset[str]:
    return frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))


# Exactly the globals a weight payload is made of: what ForkingPickler writes for CPU tensors shared
# through /dev/shm files, parameters, CUDA IPC tensors of a same-host GPU sender, torch.Size, the dtypes,
# and the bucket metadata. Nothing is matched by module alone, and a name is never traversed (pickle
# protocol 4 resolves dotted names attribute by attribute, which is how `torch` + "os.system" reaches a
# shell): a (module, name) pair is either in this set or refused.
_ALLOWED_GLOBALS = frozenset(
    {("torch", name) for name in _torch_dtype_names()}
    | {
        ("torch", "Size"),
        ("torch", "Tensor"),
        ("torch.nn.parameter", "Parameter"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("types", "SimpleNamespace"),
    }
)
_METADATA_CLASSES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"),
    ("relax.wire.serialize", "FlatMeta"),
}


class RestrictedUnpickler(pickle.Unpickler):
    """Loads torch tensors (incl. shared-memory ones), parameters and plain containers, nothing else."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES:
            return FlatMeta
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} (not a weight payload type)")
        return getattr(importlib.import_module(module), name)


def restricted_loads(data: str | bytes) -> Any:
    ensure_file_system_sharing()
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return RestrictedUnpickler(io.BytesIO(data)).load()


def _meta_get(meta: Any, key: str):
    return meta[key] if isinstance(meta, dict) else getattr(meta, key)


def unflatten_bucket(obj: dict) -> NamedTensors:
    flat = obj["flattened_tensor"]
    out: NamedTensors = []
    for meta in obj["metadata"]:
        name = _meta_get(meta, "name")
        start, end = int(_meta_get(meta, "start_idx")), int(_meta_get(meta, "end_idx"))
        dtype, shape = _meta_get(meta, "dtype"), tuple(_meta_get(meta, "shape"))
        piece = flat[start:end]
        if piece.dtype != dtype:
            # Byte-flattened buckets (uint8) are reinterpreted; anything else is converted.
            piece = piece.view(dtype) if flat.dtype == torch.uint8 else piece.to(dtype)
        out.append((name, piece.reshape(shape)))
    return out


def deserialize_named_tensors(data: str | bytes, load_format: str | None = None) -> NamedTensors:
    """Inverse of `serialize_named_tensors` (also accepts SGLang-produced payloads)."""
    obj = restricted_loads(data)
    if load_format == "flattened_bucket" or (isinstance(obj, dict) and "flattened_tensor" in obj):
        return unflatten_bucket(obj)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unsupported load_format {load_format!r}; supported: {LOAD_FORMATS}")
    if isinstance(obj, dict):
        obj = list(obj.items())
    out: NamedTensors = []
    for item in obj:
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"entry {name!r} is a {type(tensor).__name__}, not a tensor")
        out.append((str(name), tensor))
    return out
