"""Weight sync over a torch.distributed group (SGLang's `/init_weights_update_group` +
`/update_weights_from_distributed` protocol).

Protocol (as in SGLang):
1. The trainer (rank 0, the broadcaster) POSTs `/init_weights_update_group` to every engine with
   `{master_address, master_port, rank_offset, world_size, group_name, backend}`; each engine rank
   joins as `rank_offset + tp_rank`. The trainer joins as rank 0 *while those requests are in
   flight* (rank 0 hosts the TCP store the others connect to). world_size = 1 + all engine ranks.
2. For an update, the trainer POSTs `/update_weights_from_distributed {names, dtypes, shapes,
   group_name, weight_version}` to every engine and, while those are in flight, broadcasts each
   tensor from rank 0 in the same order. Engines allocate empty tensors and receive.

The group is a separate process group created the way SGLang does (rendezvous + PrefixStore +
`_new_process_group_helper`), so it coexists with a trainer's default group and is
wire-compatible with a real SGLang server. On CPU use backend "gloo" (NCCL needs GPUs).
"""

from __future__ import annotations

import inspect
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from relax.wire.engine_client import EngineClient

logger = logging.getLogger(__name__)


def dtype_from_str(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).replace("torch.", "")
    dt = getattr(torch, key, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def init_custom_process_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 600.0,
):
    """Create (join) a process group independent of the default one; return it."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    opts_kw = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **{opts_kw: None},
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _broadcast(tensor: torch.Tensor, pg, async_op: bool = False):
    try:
        return dist.broadcast(tensor, group=pg, group_src=0, async_op=async_op)
    except TypeError:  # torch without group_src
        return dist.broadcast(tensor, src=0, group=pg, async_op=async_op)


def receive_broadcast(pg, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]):
    """Engine side: receive tensors broadcast from rank 0, in order."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
    out = []
    works = []
    for name, dt, shape in zip(names, dtypes, shapes):
        t = torch.empty(tuple(int(s) for s in shape), dtype=dtype_from_str(dt))
        works.append(_broadcast(t, pg, async_op=True))
        out.append((name, t))
    for w in works:
        w.wait()
    return out


def broadcast_tensors(pg, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Trainer side: broadcast each tensor from rank 0, in order."""
    for _, t in named_tensors:
        t = t.detach()
        if t.device.type != "cpu" and dist.get_backend(pg) == "gloo":
            t = t.cpu()
        _broadcast(t.contiguous(), pg)


def destroy_process_group(pg) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception as exc:  # pragma: no cover - best effort
        logger.warning("destroying weight update group failed: %r", exc)


class WeightUpdateGroup:
    """The trainer's end of a weight-update group spanning one or more engines.

    >>> group = WeightUpdateGroup([client_a, client_b], master_address="127.0.0.1", master_port=port)
    >>> group.init()                          # engines join at rank_offset 1, 1 + tp(a), ...
    >>> group.update(named_tensors, weight_version="3")
    >>> group.destroy()
    """

    def __init__(
        self,
        clients: Sequence[EngineClient],
        *,
        master_address: str,
        master_port: int,
        group_name: str = "relax_weight_update",
        backend: str = "gloo",
        tp_sizes: Sequence[int] | None = None,
        timeout_s: float = 600.0,
    ):
        self.clients = list(clients)
        self.master_address = master_address
        self.master_port = int(master_port)
        self.group_name = group_name
        self.backend = backend
        self.timeout_s = timeout_s
        self.tp_sizes = list(tp_sizes) if tp_sizes is not None else [c.tp_size() for c in self.clients]
        self.rank_offsets = []
        off = 1
        for tp in self.tp_sizes:
            self.rank_offsets.append(off)
            off += tp
        self.world_size = off
        self.pg = None

    def _fan_out(self, fn) -> list[Future]:
        pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)))
        try:
            return [pool.submit(fn, c, i) for i, c in enumerate(self.clients)]
        finally:
            pool.shutdown(wait=False)

    def init(self) -> None:
        futures = self._fan_out(
            lambda c, i: c._post_init_group(
                master_address=self.master_address,
                master_port=self.master_port,
                rank_offset=self.rank_offsets[i],
                world_size=self.world_size,
                group_name=self.group_name,
                backend=self.backend,
            )
        )
        try:
            self.pg = init_custom_process_group(
                backend=self.backend,
                master_address=self.master_address,
                master_port=self.master_port,
                rank=0,
                world_size=self.world_size,
                group_name=self.group_name,
                timeout_s=self.timeout_s,
            )
        finally:
            errors = []
            for f in futures:
                try:
                    f.result(timeout=self.timeout_s)
                except Exception as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]

    def update(
        self,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        if self.pg is None:
            raise RuntimeError("call init() first")
        named_tensors = list(named_tensors)
        payload = {
            "names": [n for n, _ in named_tensors],
            "dtypes": [dtype_to_str(t.dtype) for _, t in named_tensors],
            "shapes": [list(t.shape) for _, t in named_tensors],
            "group_name": self.group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        futures = self._fan_out(lambda c, i: c._post_update_distributed(payload))
        broadcast_error = None
        try:
            broadcast_tensors(self.pg, named_tensors)
        except Exception as exc:  # still collect the engines' answers
            broadcast_error = exc
        errors = []
        for f in futures:
            try:
                f.result(timeout=self.timeout_s)
            except Exception as exc:
                errors.append(exc)
        if broadcast_error is not None:
            raise broadcast_error
        if errors:
            raise errors[0]

    def destroy(self) -> None:
        for c in self.clients:
            try:
                c._post("/destroy_weights_update_group", {"group_name": self.group_name}, allow_404=True)
            except Exception as exc:  # pragma: no cover
                logger.warning("destroy_weights_update_group on %s failed: %r", c.base_url, exc)
        if self.pg is not None:
            destroy_process_group(self.pg)
            self.pg = None
