"""Shared-memory weight transport on one host: one reusable segment, a JSON manifest over HTTP.

The pickled `/update_weights_from_tensor` payload (`relax.wire.serialize`) costs a staging copy,
a fresh shared-memory mapping per update on the engine side and intermediate tensors. This path,
`load_format="relax_shm"` (spoken by the embedded engine, which advertises it in `/server_info`
`weight_update_formats`), moves weight bytes through memory exactly twice:

- The sender owns one file in /dev/shm (`ShmSegment`, `relax-ws-*`), created once and mapped once
  (`torch.from_file(shared=True)`), reused by every update, removed on `close()`. Its size is the
  `--update-weight-buffer-size` budget at most; it is split into two slots so that the trainer writes
  chunk i+1 while the engines copy chunk i (`pack_chunks`; about 8 chunks per update, `slot_bytes_for`).
- Each tensor is written into the current slot with one `copy_` (a tensor bigger than the room left
  is split at element boundaries and continues in the next chunk), then the slot is described by a
  small JSON manifest: `{"segment": path, "segment_bytes": n, "tensors": [[name, dtype, shape,
  start, numel, offset], ...]}`: elements `[start, start + numel)` of the row-major tensor `name`
  (full shape `shape`, dtype `dtype`) lie at byte `offset` of the segment.
- The engine maps the segment once (`SegmentCache`, kept across updates), builds views on it
  (`manifest_views`, no copies) and copies each view straight into its parameter slice.

The manifest travels as the single entry of `serialized_named_tensors`, so the request keeps the
shape of SGLang's; the weight version goes with the last chunk only.

One copy (`load_format="relax_shm_bind"`, `BoundSegment`, the default when every engine advertises it and
/dev/shm has room for two copies of the model): the segment holds the whole update twice (two halves);
the sender writes the half the engines are not using, one manifest names it, and each engine points its
parameters at views of that half instead of copying (see the section at the end of this file).
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from relax.config.env import shm_dir

LOAD_FORMAT = "relax_shm"
PREFIX = "relax-ws-"
ALIGN = 64  # byte alignment of every piece in the segment (any dtype can be viewed there)

_DTYPES = {str(dt).replace("torch.", ""): dt for dt in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool)}


def dtype_name(dt: torch.dtype) -> str:
    name = str(dt).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dt} cannot travel through the shared-memory weight path")
    return name


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


_LIVE: "weakref.WeakSet[ShmSegment]" = weakref.WeakSet()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(directory: str | None = None) -> list[str]:
    """Remove segments (`relax-ws-PID-*`) whose creating process is gone (a killed trainer cannot clean up;
    engines keep their own mapping of a removed file until they see a new one). Returns the removed paths."""
    directory = directory or shm_dir()
    removed = []
    for entry in os.listdir(directory):
        if not entry.startswith(PREFIX):
            continue
        pid = entry[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            try:
                os.unlink(os.path.join(directory, entry))
                removed.append(os.path.join(directory, entry))
            except OSError:
                pass
    return removed


@atexit.register
def _close_live_segments() -> None:
    for seg in list(_LIVE):
        seg.close()


class ShmSegment:
    """A file in /dev/shm of `nbytes` (`relax-ws-PID-*`), mapped read-write into this process as a uint8
    tensor; removed by `close()`, at exit, or by the next sender's `sweep_stale_segments` once PID is gone."""

    def __init__(self, nbytes: int, directory: str | None = None):
        nbytes = _align(max(int(nbytes), ALIGN))
        directory = directory or shm_dir()
        sweep_stale_segments(directory)
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=directory)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self.path, self.nbytes = path, nbytes
        try:
            self.buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            self.buf.zero_()  # fault the pages in now, not during the first update
        except BaseException:
            os.unlink(path)
            raise
        _LIVE.add(self)

    def close(self) -> None:
        self.buf = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __del__(self):  # best effort: never leave files in /dev/shm behind
        try:
            if getattr(self, "path", None) and os.path.exists(self.path):
                os.unlink(self.path)
        except Exception:
            pass


PIPELINE_CHUNKS = 8  # an update is cut into about this many chunks (fewer when the buffer is small)
MIN_SLOT_BYTES = 8 << 20  # ... but chunks stay big enough that the per-request cost does not matter


def slot_bytes_for(named: Sequence[tuple[str, torch.Tensor]], buffer_bytes: int) -> int:
    """Size of one of the two slots: about 1/PIPELINE_CHUNKS of the update (so that writing and the
    engines' copying overlap), at least MIN_SLOT_BYTES, at most half the buffer budget."""
    total = sum(_align(t.numel() * t.element_size()) for _, t in named)
    biggest_element = max((t.element_size() for _, t in named), default=1)
    want = max(-(-total // PIPELINE_CHUNKS), MIN_SLOT_BYTES)
    return _align(max(min(int(buffer_bytes) // 2, want, total), biggest_element))


def _flat_cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def pack_chunks(named: Iterable[tuple[str, torch.Tensor]], seg: torch.Tensor, slot_bytes: int,
                send: Callable[[list, bool], Future | None]) -> dict:
    """Write `named` into the two slots of `seg` (a uint8 tensor of >= 2 * slot_bytes) in turn and call
    `send(entries, last)` for each filled slot; `send` returns a future (the engines' answer) or None.

    A slot is written only after the answer for the chunk that used it before has come, and at most
    one chunk is in flight while the next is written (ordered requests, double buffering).
    Returns {"chunks", "tensors", "bytes"}. Raises what a future raised.
    """
    if seg.numel() < 2 * slot_bytes:
        raise ValueError(f"segment of {seg.numel()} bytes cannot hold two slots of {slot_bytes}")
    state = {"slot": 0, "fill": 0, "entries": [], "pending": None, "chunks": 0}

    def flush(last: bool) -> None:
        pending = state["pending"]
        state["pending"] = None
        if pending is not None:
            pending.result()
        state["pending"] = send(state["entries"], last)
        state["chunks"] += 1
        state["slot"] ^= 1
        state["fill"], state["entries"] = 0, []

    n_tensors = n_bytes = 0
    try:
        for name, t in named:
            flat = _flat_cpu(t)
            es, n, start = flat.element_size(), flat.numel(), 0
            dname, shape = dtype_name(flat.dtype), list(t.shape)
            n_tensors += 1
            n_bytes += n * es
            while start < n or n == 0:
                off = _align(state["fill"])
                room = (slot_bytes - off) // es
                if room <= 0:
                    flush(False)
                    continue
                k = min(room, n - start)
                base = state["slot"] * slot_bytes + off
                if k:
                    seg[base:base + k * es].view(flat.dtype).copy_(flat[start:start + k])
                state["entries"].append([name, dname, shape, start, k, base])
                state["fill"] = off + k * es
                start += k
                if n == 0:
                    break
        if not state["entries"] and state["chunks"] == 0:
            raise ValueError("no tensors to send")
        flush(True)
        pending, state["pending"] = state["pending"], None
        if pending is not None:
            pending.result()
    finally:
        pending = state["pending"]
        if pending is not None:  # an error while writing: let the chunk in flight finish before returning
            try:
                pending.result()
            except Exception:
                pass
    return {"chunks": state["chunks"], "tensors": n_tensors, "bytes": n_bytes}


def manifest(seg: "ShmSegment", entries: list) -> str:
    return json.dumps({"segment": seg.path, "segment_bytes": seg.nbytes, "tensors": entries},
                      separators=(",", ":"))


# ---------------------------------------------------------------------------------------------
# Receiving side
# ---------------------------------------------------------------------------------------------


class SegmentCache:
    """The engine's mappings of sender segments, by path, kept across updates (no re-mapping, no page
    faults after the first update); a mapping is dropped once its file is gone (the sender closed)."""

    def __init__(self, max_segments: int = 4):
        self.max_segments = max_segments
        self._maps: dict[tuple[str, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    @staticmethod
    def check_path(path: str) -> str:
        real = os.path.realpath(path)
        if not os.path.basename(real).startswith(PREFIX) or os.path.dirname(real) not in {
                os.path.realpath(shm_dir()), os.path.realpath(tempfile.gettempdir()), "/dev/shm"}:
            raise ValueError(f"refusing to map {path!r}: not a relax weight segment ({PREFIX}* in /dev/shm)")
        if not os.path.isfile(real):
            raise ValueError(f"shared-memory segment {path} does not exist (is the sender on this host?)")
        return real

    def get(self, path: str, nbytes: int) -> torch.Tensor:
        with self._lock:
            for key in [k for k in self._maps if k[0] != path and not os.path.exists(k[0])]:
                del self._maps[key]
            buf = self._maps.get((path, nbytes))
            if buf is None:
                real = self.check_path(path)
                size = os.path.getsize(real)
                if size < nbytes:
                    raise ValueError(f"segment {path} holds {size} bytes, the manifest says {nbytes}")
                buf = torch.from_file(real, shared=True, size=nbytes, dtype=torch.uint8)
                while len(self._maps) >= self.max_segments:
                    del self._maps[next(iter(self._maps))]
                self._maps[(path, nbytes)] = buf
            return buf

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()


def parse_manifest(data: str | bytes) -> dict:
    obj = json.loads(data)
    if not isinstance(obj, dict) or not isinstance(obj.get("tensors"), list) or "segment" not in obj:
        raise ValueError("a relax_shm manifest is {segment, segment_bytes, tensors}")
    return obj


def manifest_views(obj: dict, cache: SegmentCache) -> Iterator[tuple[str, tuple, int, torch.Tensor]]:
    """(name, full shape, start element, 1-D view of the segment) per manifest entry; no copies."""
    nbytes = int(obj["segment_bytes"])
    seg = cache.get(str(obj["segment"]), nbytes)
    for name, dname, shape, start, numel, offset in obj["tensors"]:
        dt = _DTYPES.get(dname)
        if dt is None:
            raise ValueError(f"{name}: unknown dtype {dname!r}")
        es = dt.itemsize
        offset, numel, start = int(offset), int(numel), int(start)
        if offset < 0 or numel < 0 or start < 0 or offset % es or offset + numel * es > nbytes:
            raise ValueError(f"{name}: bytes [{offset}, {offset + numel * es}) lie outside the segment")
        yield str(name), tuple(int(s) for s in shape), start, seg[offset:offset + numel * es].view(dt)


def shm_capable(info: Any) -> bool:
    """Whether a `/server_info` answer advertises this path."""
    return isinstance(info, dict) and LOAD_FORMAT in (info.get("weight_update_formats") or ())


def bind_capable(info: Any) -> bool:
    """Whether a `/server_info` answer advertises the one-copy path (`LOAD_FORMAT_BIND`)."""
    return isinstance(info, dict) and LOAD_FORMAT_BIND in (info.get("weight_update_formats") or ())


# ---------------------------------------------------------------------------------------------
# One-copy path (`load_format="relax_shm_bind"`): the engines' parameters live in the segment
# ---------------------------------------------------------------------------------------------
#
# The sender owns one segment of two halves, each big enough for the whole update. A push writes every
# tensor once into the half the engines are not using and posts one manifest (same format as above,
# whole tensors only); each engine, at a step boundary, points its parameters at views of that half
# (`relax.backends.embedded.shared_weights`) and takes the new weight version. The next push writes the
# other half: after a push has been answered no engine reads the half written next, so generation in
# flight never sees a half-written tensor. Memory: two copies of the model per host, whatever the number
# of engines (they all map the same segment), instead of one per engine plus a staging buffer.

LOAD_FORMAT_BIND = "relax_shm_bind"


def shm_room(directory: str | None = None) -> int:
    """Bytes still free in the segment folder (tmpfs /dev/shm is often small in containers)."""
    st = os.statvfs(directory or shm_dir())
    return st.f_bavail * st.f_frsize


class BoundSegment:
    """Sender side of the one-copy path: the double-buffered segment and which half is written next.

    `write(named, cast)` fills the next half and returns the manifest entries; `commit()` after every
    engine answered (the half becomes theirs, the next push uses the other one); `discard()` after a
    failure (an engine may still apply the update later, so neither half is written again: the next push
    starts a new segment, and engines keep their own mapping of the old one until they rebind)."""

    def __init__(self, directory: str | None = None):
        self.directory = directory
        self.segment: ShmSegment | None = None
        self.half_bytes = 0
        self.half = 0

    @staticmethod
    def layout(named: Sequence[tuple[str, torch.Tensor]], cast: Callable[[str, torch.Tensor], torch.dtype]):
        """[(name, tensor, dtype on the wire, byte offset in a half)], bytes of one half."""
        out, off = [], 0
        for name, t in named:
            dt = cast(name, t)
            dtype_name(dt)
            off = _align(off)
            out.append((name, t, dt, off))
            off += t.numel() * dt.itemsize
        return out, _align(max(off, ALIGN))

    def needed_bytes(self, half_bytes: int) -> int:
        """Bytes a new segment for halves of `half_bytes` takes (0 when the current one fits)."""
        return 0 if self.segment is not None and self.half_bytes >= half_bytes else 2 * half_bytes

    def write(self, named: Sequence[tuple[str, torch.Tensor]],
              cast: Callable[[str, torch.Tensor], torch.dtype] = lambda _n, t: t.dtype) -> list:
        plan, half_bytes = self.layout(named, cast)
        if self.needed_bytes(half_bytes):
            self.close()
            self.segment = ShmSegment(2 * half_bytes, self.directory)
            self.half_bytes, self.half = half_bytes, 0
        base, buf, entries = self.half * self.half_bytes, self.segment.buf, []
        for name, t, dt, off in plan:
            n = t.numel()
            start = base + off
            if n:  # one copy per tensor, straight from where it is (any layout or device), converting to
                # the engines' dtype on the way when asked to: no intermediate tensor
                buf[start:start + n * dt.itemsize].view(dt).view(t.shape).copy_(t.detach())
            entries.append([name, dtype_name(dt), list(t.shape), 0, n, start])
        return entries

    def commit(self) -> None:
        self.half ^= 1

    def discard(self) -> None:
        self.close()

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        self.half_bytes, self.half = 0, 0
