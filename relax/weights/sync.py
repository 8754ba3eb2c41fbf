"""Weight sync, trainer -> engines: one interface, three transports, versioned, verified, loud on failure.

`WeightSync` implementations (pick one with `make_weight_sync(method, ...)`):

- `tensor`: SGLang's `/update_weights_from_tensor`; the HF-named tensors go through shared memory on one
  host. Engines that advertise `relax_shm_bind` (the embedded engine) get one copy: the trainer writes
  every tensor once into a /dev/shm segment that holds the model twice and the engines' parameters
  become views of the half just written (`relax.weights.shm`). Engines that only advertise `relax_shm`,
  or a /dev/shm without room for the model twice, get two copies through one reused segment of
  `buffer_bytes`; others get SGLang's pickle, in buffers of `buffer_bytes`, each staged once and posted
  to every engine concurrently.
- `disk`: the tensors are written as safetensors (plus the HF config/tokenizer files when a source
  folder is known, as real SGLang needs) into a fresh temporary folder, then every engine is told to
  `/update_weights_from_disk` from it; the folder is removed afterwards.
- `distributed`: SGLang's `/init_weights_update_group` (once, kept across updates) +
  `/update_weights_from_distributed`: the trainer broadcasts each tensor over a torch.distributed
  group (gloo on CPU, NCCL on GPUs) that every engine rank joins.

Every push carries a weight version; afterwards each engine must report exactly that version
(`/get_weight_version`). With `check_equal` (`--check-weight-update-equal`) every tensor is also read
back in full with `/get_weights_by_name` and compared with what was sent. A failing, refused or
timed-out sync raises `WeightSyncError` naming the engine; nothing is left silently stale.

`push_named_tensors` (the function the trainer role calls) keeps its signature and delegates.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence
from urllib.parse import urlparse

import torch
from safetensors.torch import save_file

from relax.wire.engine_client import EngineClient, EngineRequestError, update_weights_from_tensor_many
from relax.wire.net import find_free_port
from relax.weights import shm
from relax.weights.distributed import WeightUpdateGroup

logger = logging.getLogger(__name__)

METHODS = ("tensor", "disk", "distributed")
NamedTensors = Sequence[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message names the engine (URL) and what went wrong."""

    def __init__(self, message: str, engine: str | None = None):
        super().__init__(message)
        self.engine = engine


def _nbytes(named: NamedTensors) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


class WeightSync:
    """Push HF-named tensors to a fixed set of engines. Subclasses implement `_send`."""

    method = "?"

    def __init__(self, engine_urls: Sequence[str], *, buffer_bytes: int = 512 << 20, timeout_s: float = 300.0,
                 check_equal: bool = False, deadline_flag: str | None = None, **_: Any):
        """`timeout_s`: each request to an engine (a chunk, the version check); `deadline_flag`: the flag it
        came from (--weight-update-timeout in a run), named when an engine does not answer in time."""
        self.engine_urls = [u if u.startswith(("http://", "https://")) else "http://" + u for u in engine_urls]
        self.buffer_bytes = int(buffer_bytes)
        self.timeout_s = float(timeout_s)
        self.check_equal = bool(check_equal)
        self.clients = [EngineClient(u, timeout_s=self.timeout_s, deadline_flag=deadline_flag)
                        for u in self.engine_urls]
        self.pushes = 0

    # ------------------------------------------------------------------ public
    def push(self, named: NamedTensors, version: int | str) -> dict[str, Any]:
        """Send `named` to every engine as weight version `version` and verify. Returns a report:
        seconds, bytes (sent, summed over engines), bytes_per_s, engines, method, send/verify seconds."""
        named = [(n, t) for n, t in named]
        if not self.clients:
            return {"seconds": 0.0, "bytes": 0, "engines": 0, "bytes_per_s": 0.0, "method": self.method}
        if not named:
            raise WeightSyncError("no tensors to send")
        t0 = time.perf_counter()
        self._send(named, str(version))
        t1 = time.perf_counter()
        self.verify(named, str(version))
        t2 = time.perf_counter()
        self.pushes += 1
        total = _nbytes(named) * len(self.clients)
        return {"seconds": t2 - t0, "send_seconds": t1 - t0, "verify_seconds": t2 - t1, "bytes": total,
                "engines": len(self.clients), "bytes_per_s": total / (t2 - t0) if t2 > t0 else 0.0,
                "method": self.method, "transport": getattr(self, "last_mode", None) or self.method}

    def verify(self, named: NamedTensors, version: str) -> None:
        """Every engine serves `version`; with `check_equal`, every tensor it holds equals the one sent."""
        def check(client: EngineClient) -> None:
            try:
                served = client.get_weight_version()
            except Exception as exc:
                raise WeightSyncError(f"engine {client.base_url}: could not read its weight version after the "
                                      f"sync to {version}: {exc}", client.base_url) from None
            if str(served) != str(version):
                raise WeightSyncError(f"engine {client.base_url} serves weight version {served!r} after a "
                                      f"{self.method} sync to {version}", client.base_url)
            if self.check_equal:
                self._check_equal(client, named, version)

        self._each(check)

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def __enter__(self) -> "WeightSync":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _send(self, named: NamedTensors, version: str) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _each(self, fn) -> None:
        """fn(client) for every engine concurrently; raise the first failure as a WeightSyncError naming it."""
        if len(self.clients) == 1:
            results = [self._guard(fn, self.clients[0])]
        else:
            with ThreadPoolExecutor(max_workers=len(self.clients)) as ex:
                futures = [ex.submit(self._guard, fn, c) for c in self.clients]
            results = [f.result() for f in futures]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    def _guard(self, fn, client: EngineClient):
        try:
            fn(client)
            return None
        except WeightSyncError as exc:
            return exc
        except Exception as exc:
            return WeightSyncError(f"{self.method} weight push to engine {client.base_url} failed: {exc}",
                                   client.base_url)

    def _check_equal(self, client: EngineClient, named: NamedTensors, version: str) -> None:
        bad = []
        for name, sent in named:
            try:
                values = client.get_weights_by_name(name, truncate_size=max(1, sent.numel()))
            except Exception as exc:
                raise WeightSyncError(f"engine {client.base_url}: cannot read back {name} for "
                                      f"--check-weight-update-equal: {exc}", client.base_url) from None
            got = torch.tensor(values, dtype=torch.float64).flatten()
            want = sent.detach().to("cpu").flatten()
            if got.numel() != want.numel():
                bad.append(f"{name}: {got.numel()} values read back, {want.numel()} sent")
                continue
            # The engine may hold a lower precision than was sent: compare in the engine's terms when
            # the values differ only by that rounding.
            if not torch.equal(got, want.double()):
                engine_dtype = _engine_dtype(client)
                if engine_dtype is None or not torch.equal(got, want.to(engine_dtype).double()):
                    err = (got - want.double()).abs().max().item()
                    bad.append(f"{name}: max abs difference {err:.3g}")
            if len(bad) >= 8:
                break
        if bad:
            raise WeightSyncError(f"engine {client.base_url} holds weights different from the trainer's after the "
                                  f"{self.method} sync to {version}: {'; '.join(bad)}", client.base_url)


def _engine_dtype(client: EngineClient) -> torch.dtype | None:
    try:
        name = str(client.server_info().get("dtype") or "").replace("torch.", "")
    except Exception:
        return None
    dt = getattr(torch, name, None) if name else None
    return dt if isinstance(dt, torch.dtype) else None


class TensorSync(WeightSync):
    """Shared memory on one host. Engines that advertise `relax_shm_bind` (the embedded engine) get the
    one-copy path of `relax.weights.shm`: one segment holding the model twice, the trainer writes the half
    the engines are not using, and their parameters become views of it (one request per push). With
    `shm_mode="chunked"`, when /dev/shm has no room for two copies of the model, or for engines that only
    advertise `relax_shm`: the two-copy path, one reusable segment of at most `buffer_bytes` (two slots:
    the next chunk is written while the engines copy the last one) and a JSON manifest per chunk. Other
    engines (real SGLang) get SGLang's pickled flattened buckets."""

    method = "tensor"

    def __init__(self, engine_urls: Sequence[str], **kw: Any):
        super().__init__(engine_urls, **kw)
        self.load_format = kw.get("load_format", "flattened_bucket")
        self.use_shm = kw.get("use_shm")  # None: when every engine advertises it; False: never
        self.shm_mode = kw.get("shm_mode")  # None: one copy when possible; "bind"; "chunked"
        if self.shm_mode not in (None, "bind", "chunked"):
            raise ValueError(f"shm_mode {self.shm_mode!r}: one of None, 'bind', 'chunked'")
        self.segment = None  # the two-copy path's staging segment
        self.bound = shm.BoundSegment()  # the one-copy path's double-buffered segment
        self._dispatch = None
        self._infos: list | None = None
        self._capable: bool | None = None
        self.last_chunks = 0
        self.last_mode: str | None = None  # "bind", "chunked" or "pickle": what the last push used
        self.last_timing: dict[str, Any] = {}  # seconds of the last one-copy push's parts

    def _server_infos(self) -> list | None:
        """Every engine's /server_info (fetched once), None when one has no such endpoint."""
        if self._infos is None:
            infos = []
            for c in self.clients:
                try:
                    infos.append(c.server_info())
                except EngineRequestError as exc:
                    if exc.status is None:  # no answer at all: the pickled path would only wait for it again
                        raise WeightSyncError(f"{self.method} weight push to engine {c.base_url} failed: {exc}",
                                              c.base_url) from None
                    infos.append(None)  # an engine without /server_info: the pickled path raises what it has to
            self._infos = infos
        return None if any(i is None for i in self._infos) else self._infos

    def _shm_ready(self) -> bool:
        if self.use_shm is False:
            return False
        if self._capable is None:
            infos = self._server_infos()
            self._capable = infos is not None and all(shm.shm_capable(info) for info in infos)
        return self._capable

    def _mode(self, named: NamedTensors) -> str:
        if not self._shm_ready():
            return "pickle"
        infos = self._server_infos()
        if self.shm_mode != "chunked" and all(shm.bind_capable(i) for i in infos):
            _, half = shm.BoundSegment.layout(named, self._cast_for(infos))
            need = self.bound.needed_bytes(half)
            if self.shm_mode == "bind" or need <= shm.shm_room() - (64 << 20):
                return "bind"
            if self.last_mode != "chunked":
                logger.warning("weight sync: /dev/shm has %.0f MB free, the one-copy path needs %.0f MB (the "
                               "model twice); using the two-copy path", shm.shm_room() / 1e6, need / 1e6)
        return "chunked"

    @staticmethod
    def _cast_for(infos: list):
        """The dtype each tensor is written in: the engines' own (one for all, when they agree) for
        floating tensors they keep in it, so that their parameters can be views of the segment."""
        dtypes = {str(i.get("dtype") or "") for i in infos}
        engine_dt = getattr(torch, dtypes.pop(), None) if len(dtypes) == 1 else None
        if not isinstance(engine_dt, torch.dtype) or not engine_dt.is_floating_point:
            return lambda _n, t: t.dtype
        keep: dict[str, str] = {}
        for i in infos:
            keep.update(i.get("weight_dtype_exceptions") or {})
        return lambda n, t: t.dtype if not t.is_floating_point() or n in keep else engine_dt

    def _send(self, named: NamedTensors, version: str) -> None:
        mode = self._mode(named)
        if mode == "bind":
            self._send_bind(named, version)
        elif mode == "chunked":
            self._send_shm(named, version)
        else:
            try:
                # all engines at once: each bucket staged in shared memory once (relax.wire.engine_client)
                update_weights_from_tensor_many(self.clients, named, version, self.buffer_bytes,
                                                load_format=self.load_format, pool=self.clients[0].buffer_pool)
            except Exception as exc:
                url = getattr(exc, "base_url", None) or ", ".join(self.engine_urls)
                raise WeightSyncError(f"tensor weight push to engine {url} failed: {exc}", url) from None
        self.last_mode = mode

    def _send_bind(self, named: NamedTensors, version: str) -> None:
        self._close_segment()  # the two-copy path's staging memory is not needed any more
        t0 = time.perf_counter()
        entries = self.bound.write(named, self._cast_for(self._server_infos()))
        payload = {"serialized_named_tensors": [shm.manifest(self.bound.segment, entries)],
                   "load_format": shm.LOAD_FORMAT_BIND, "flush_cache": True, "weight_version": version}
        t1 = time.perf_counter()
        answers: dict[str, Any] = {}

        def post(c: EngineClient) -> None:
            answers[c.base_url] = c._post("/update_weights_from_tensor", payload, check_success=True)

        try:
            self._each(post)
        except BaseException:
            self.bound.discard()  # an engine may still apply this later: never write either half again
            raise
        self.bound.commit()
        self.last_chunks = 1
        # where a push's time goes (benchmarks/weight_sync_bench.py prints it): the trainer's copy, then
        # the engines' answers, of which the engine itself spent elapsed_s (apply_s on its scheduler thread)
        engine = next(iter(answers.values()), None) or {}
        self.last_timing = {"write_s": t1 - t0, "post_s": time.perf_counter() - t1,
                            "engine_elapsed_s": engine.get("elapsed_s"), "engine_apply_s": engine.get("apply_s")}

    def _send_shm(self, named: NamedTensors, version: str) -> None:
        self.bound.close()
        slot = shm.slot_bytes_for(named, self.buffer_bytes)
        if self.segment is None or self.segment.nbytes < 2 * slot:
            self._close_segment()
            self.segment = shm.ShmSegment(2 * slot)
        if self._dispatch is None:
            self._dispatch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-weight-sync")
        seg = self.segment

        def post(client: EngineClient, data: str, last: bool) -> None:
            payload: dict[str, Any] = {"serialized_named_tensors": [data], "load_format": shm.LOAD_FORMAT,
                                       "flush_cache": last}
            if last:
                payload["weight_version"] = version
            client._post("/update_weights_from_tensor", payload, check_success=True)

        def send(entries: list, last: bool):
            data = shm.manifest(seg, entries)
            return self._dispatch.submit(self._each, lambda c: post(c, data, last))

        self.last_chunks = shm.pack_chunks(named, seg.buf, slot, send)["chunks"]

    def _close_segment(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    def close(self) -> None:
        if self._dispatch is not None:
            self._dispatch.shutdown(wait=True)
            self._dispatch = None
        self._close_segment()
        self.bound.close()
        super().close()


def copy_model_files(source_dir: str, dest: str) -> None:
    """Copy an HF folder's non-weight files (config, generation config, tokenizer, chat template)."""
    for entry in os.listdir(source_dir):
        src = os.path.join(source_dir, entry)
        if os.path.isfile(src) and not entry.endswith((".safetensors", ".bin", ".pt", ".pth", ".index.json")):
            shutil.copy2(src, os.path.join(dest, entry))


def write_safetensors_dir(named: NamedTensors, path: str, *, source_dir: str | None = None,
                          max_shard_bytes: int = 4 << 30) -> list[str]:
    """Write `named` as HF safetensors shards (with an index when sharded) into folder `path`; copy the
    non-weight files (config, generation config, tokenizer) of `source_dir` when given. Returns the files."""
    os.makedirs(path, exist_ok=True)
    if source_dir and os.path.isdir(source_dir):
        copy_model_files(source_dir, path)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    files = []
    if len(shards) == 1:
        files.append("model.safetensors")
        save_file(_unshared(shards[0]), os.path.join(path, files[0]), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(_unshared(shard), os.path.join(path, fname), metadata={"format": "pt"})
            files.append(fname)
            weight_map.update(dict.fromkeys(shard, fname))
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(_nbytes(list(s.items())) for s in shards)},
                       "weight_map": weight_map}, f)
    return files


def _unshared(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing storage (tied embeddings): give each its own copy."""
    seen: set[int] = set()
    out = {}
    for k, t in shard.items():
        ptr = t.untyped_storage().data_ptr()
        out[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


class DiskSync(WeightSync):
    method = "disk"

    def __init__(self, engine_urls: Sequence[str], *, tmp_dir: str | None = None, source_dir: str | None = None,
                 **kw: Any):
        super().__init__(engine_urls, **kw)
        self.tmp_dir = tmp_dir
        self.source_dir = source_dir

    def _send(self, named: NamedTensors, version: str) -> None:
        folder = tempfile.mkdtemp(prefix=f"relax-weights-v{version}-", dir=self.tmp_dir)
        try:
            write_safetensors_dir(named, folder, source_dir=self.source_dir)
            self._each(lambda c: c.update_weights_from_disk(folder, weight_version=version))
        finally:
            shutil.rmtree(folder, ignore_errors=True)


class DistributedSync(WeightSync):
    method = "distributed"

    def __init__(self, engine_urls: Sequence[str], *, backend: str | None = None, master_address: str | None = None,
                 group_name: str = "relax_weight_update", **kw: Any):
        super().__init__(engine_urls, **kw)
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.master_address = master_address
        self.group_name = group_name
        self.group = None

    def _ensure_group(self) -> None:
        if self.group is not None:
            return
        address = self.master_address or _local_address(self.engine_urls)
        group = WeightUpdateGroup(self.clients, master_address=address, master_port=find_free_port(),
                                  group_name=self.group_name, backend=self.backend, timeout_s=self.timeout_s)
        try:
            group.init()
        except Exception as exc:
            url = getattr(exc, "base_url", None) or ", ".join(self.engine_urls)
            raise WeightSyncError(f"engine {url} could not join the weight update group: {exc}", url) from None
        self.group = group

    def _send(self, named: NamedTensors, version: str) -> None:
        self._ensure_group()
        try:
            self.group.update(named, weight_version=version)
        except Exception as exc:
            url = getattr(exc, "base_url", None) or ", ".join(self.engine_urls)
            self.close_group()  # a broken group cannot be reused: the next push makes a new one
            raise WeightSyncError(f"distributed weight push to engine {url} failed: {exc}", url) from None

    def close_group(self) -> None:
        if self.group is not None:
            try:
                self.group.destroy()
            except Exception as exc:  # pragma: no cover - best effort
                logger.warning("destroying the weight update group failed: %r", exc)
            self.group = None

    def close(self) -> None:
        self.close_group()
        super().close()


def _local_address(engine_urls: Sequence[str]) -> str:
    """An address of this host that the engines can reach (loopback when they all run here)."""
    hosts = {urlparse(u).hostname for u in engine_urls}
    if hosts <= {"127.0.0.1", "localhost", "::1"}:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((next(h for h in hosts if h not in {"127.0.0.1", "localhost"}), 9))
        return s.getsockname()[0]


_CLASSES = {"tensor": TensorSync, "disk": DiskSync, "distributed": DistributedSync}


def make_weight_sync(method: str, engine_urls: Sequence[str], **kw: Any) -> WeightSync:
    if method not in _CLASSES:
        raise ValueError(f"unknown weight sync method {method!r}; one of {METHODS}")
    return _CLASSES[method](engine_urls, **kw)


# One live sync per (method, engines) in this process: the distributed group and the shared-memory
# staging buffers are kept between updates.
_LIVE: dict[tuple, WeightSync] = {}


def get_weight_sync(method: str, engine_urls: Sequence[str], **kw: Any) -> WeightSync:
    key = (method, tuple(engine_urls), kw.get("check_equal", False), kw.get("buffer_bytes"), kw.get("timeout_s"))
    sync = _LIVE.get(key)
    if sync is None:
        for k in [k for k in _LIVE if k[0] == method]:  # other engines or settings: replace it
            _LIVE.pop(k).close()
        sync = _LIVE[key] = make_weight_sync(method, engine_urls, **kw)
    return sync


def close_all() -> None:
    while _LIVE:
        _LIVE.popitem()[1].close()


def push_named_tensors(named: NamedTensors, engine_urls: Sequence[str], version: int, buffer_bytes: int,
                       timeout_s: float = 300.0, *, method: str = "tensor", check_equal: bool = False,
                       **kw: Any) -> dict:
    """Push to every engine with `method` (default the shared-memory tensor path) and verify the version
    (and, with `check_equal`, every tensor). Raises `WeightSyncError` naming the failing engine."""
    if not engine_urls:
        return {"seconds": 0.0, "bytes": 0, "engines": 0, "bytes_per_s": 0.0, "method": method}
    sync = get_weight_sync(method, engine_urls, buffer_bytes=buffer_bytes, timeout_s=timeout_s,
                           check_equal=check_equal, **kw)
    return sync.push(named, version)


def push_for_config(named: NamedTensors, engine_urls: Sequence[str], version: int, config: Any) -> dict:
    """`push_named_tensors` with the run's settings: `--update-weight-buffer-size`,
    `--check-weight-update-equal`, `--weight-update-timeout` (each request to an engine) and the sync method
    (`weight_sync_method` when the config has it, else the environment variable RELAX_WEIGHT_SYNC, else
    "tensor")."""
    get = config.get if hasattr(config, "get") else (lambda k, d=None: getattr(config, k, d))
    method = get("weight_sync_method", None) or os.environ.get("RELAX_WEIGHT_SYNC") or "tensor"
    return push_named_tensors(named, engine_urls, version, get("update_weight_buffer_size", 512 << 20),
                              timeout_s=float(get("weight_update_timeout", 300.0)), method=method,
                              check_equal=bool(get("check_weight_update_equal", False)),
                              deadline_flag="--weight-update-timeout",
                              source_dir=get("hf_checkpoint", None) if method == "disk" else None)
