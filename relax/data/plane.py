"""``DataPlane``: a small step-partitioned interface over TransferQueue (0.1.11).

One process (the controller process, usually the driver) calls ``DataPlane.start(...)``,
which creates the TransferQueue controller and N ``SimpleStorageUnit`` Ray actors. Every
other process / Ray actor calls ``DataPlane.attach()``. Data moves over ZMQ between the
clients and the storage units, not through the Ray object store.

Samples of training step ``s`` live in their own partition ``f"{prefix}_{s}"`` (default
``train_<s>``), so several steps can be in flight at once (asynchronous mode with bounded
staleness) and ``clear(s)`` frees one step without touching the others.

Reads:
  * ``get(step)`` (``batch_size=None``) is a non-consuming read of every sample of the
    step that is fully written, sorted by ``Sample.index``.
  * ``get(step, batch_size=k, task_name=t)`` consumes: it returns the next ``k`` samples the
    task ``t`` has not read yet (TransferQueue tracks consumption per task), lowest
    ``Sample.index`` first, or ``[]`` when fewer than ``k`` are ready (``polling_mode``);
    ``timeout_s`` polls until then; ``group_size=n`` hands out whole prompt groups only.
    Ordering and groups come from ``relax.data.sampler.IndexOrderSampler``, registered in
    the controller by ``start``: TransferQueue's default sampler follows global indexes,
    which are recycled after a clear, so it returns arbitrary subsets and splits groups.

Layouts (``start(layout=...)``, see ``relax.data.codec``): ``"columns"`` (default; one
TransferQueue field per Sample field, token fields as jagged tensors) or ``"packed"`` (one
bytes record per sample; ~3-5x faster on 2 CPU cores, opaque to other TransferQueue users).

Stage fields (``relax.data.sample.STAGE_FIELDS``): ``put`` writes a step's samples with their rollout
fields; each later stage adds its per-sample rows with ``put_fields(step, indexes, field=rows)`` to the
samples already stored (a TransferQueue field of its own, written for the samples' existing global
indexes). A read that names stage fields returns them on the Samples; a whole-step read
(``batch_size=None``) raises ``MissingFieldError`` when a stored sample lacks one of them, so a stage that
reads before its inputs were written fails by name instead of training on fewer samples.

Pitfalls handled here (measured on transferqueue 0.1.11):
  * the controller and each storage unit reserve 1 Ray CPU; on a cluster with too few CPUs
    ``transfer_queue.init`` hangs forever -> ``start`` checks the cluster first.
  * ``transfer_queue.init()`` with no controller silently starts a new default one ->
    ``attach`` looks the controller up first and fails after ``timeout_s``.
  * ``transfer_queue.close()`` in an attached process kills the shared controller ->
    ``shutdown`` of an attached plane only closes this process's client.
  * a put that fails (e.g. storage capacity exceeded) leaves allocated-but-unwritten
    indexes; TransferQueue's own ``clear_samples``/``clear_partition`` then fail with an
    IndexError in the controller (``mark_clearing``) or skip the empty partition -> ``put``
    rolls back its own samples and ``clear`` falls back to clearing storage and controller
    directly. Both use private TransferQueue client methods (``_clear_meta_in_controller``,
    ``_clear_partition_in_controller``), isolated in ``_force_clear``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Iterable, Sequence

import torch

from relax.data import tensordict_import

tensordict_import.install()  # tensordict without torch._dynamo (see the module)

from tensordict import TensorDict  # noqa: E402

from relax.data.codec import RECORD_FIELD, decode_samples, encode_records, encode_samples, encode_stage_rows  # noqa: E402
from relax.data.sample import ROLLOUT_FIELDS, STAGE_FIELDS, Sample, check_fields  # noqa: E402
from relax.data.sampler import IndexOrderSampler  # noqa: E402

os.environ.setdefault("TQ_NUM_THREADS", "1")  # TQ warns on every call when unset

import ray  # noqa: E402
import transfer_queue as tq  # noqa: E402
from transfer_queue import interface as _tq_interface  # noqa: E402

logger = logging.getLogger(__name__)

_CONTROLLER_NAME = "TransferQueueController"
_CONTROLLER_NAMESPACE = "transfer_queue"
_CONF_KEY = "relax_data_plane"  # our settings, stored in the controller's config for attach()
LAYOUTS = ("columns", "packed")

# Number of live DataPlane handles in this process. TransferQueue keeps one client per
# process in module globals; it is closed when the last handle shuts down.
_live_handles = 0


def _controller_exists(wait_dead_s: float = 10.0) -> bool:
    """Whether a live TransferQueue controller is registered. A controller killed moments ago
    can still hold its name; wait (up to ``wait_dead_s``) for the name to be released."""
    deadline = time.monotonic() + wait_dead_s
    while True:
        try:
            actor = ray.get_actor(_CONTROLLER_NAME, namespace=_CONTROLLER_NAMESPACE)
        except ValueError:
            return False
        try:
            ray.get(actor.get_zmq_server_info.remote(), timeout=30)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            if time.monotonic() > deadline:
                raise RuntimeError("A dead TransferQueue controller still holds its name") from None
            time.sleep(0.2)


class MissingFieldError(RuntimeError):
    """A read named stage fields that some stored samples of the step do not have (yet)."""


class DataPlane:
    """Step-partitioned store of ``Sample`` batches on TransferQueue.

    Create with ``DataPlane.start`` (once, in the controller process) or ``DataPlane.attach``
    (anywhere else in the same Ray cluster); do not call the constructor directly.
    """

    def __init__(
        self,
        *,
        owner: bool,
        partition_prefix: str = "train",
        logprob_dtype: torch.dtype = torch.float32,
        layout: str = "columns",
        config: Any = None,
    ) -> None:
        global _live_handles
        if not partition_prefix or "_" in partition_prefix:
            raise ValueError(f"partition_prefix must be non-empty and contain no '_': {partition_prefix!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self._layout = layout
        self._owner = owner
        self._prefix = partition_prefix
        self._logprob_dtype = logprob_dtype
        self._config = config
        self._client = tq.get_client()
        self._closed = False
        _live_handles += 1

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(
        cls,
        num_storage_units: int = 2,
        capacity_samples: int | None = None,
        polling_mode: bool = True,
        *,
        partition_prefix: str = "train",
        logprob_dtype: torch.dtype = torch.float32,
        layout: str = "columns",
        sampler: Any = None,
    ) -> "DataPlane":
        """Create the TransferQueue controller and ``num_storage_units`` SimpleStorageUnit
        actors, and return an owning handle. Requires ``ray.init`` to have been called.

        ``capacity_samples`` bounds the samples held across all units (None: unbounded).
        TransferQueue splits it evenly (ceil) per unit and routes sample ``g`` to unit
        ``g % N``, so a put can be refused slightly before the total is reached.
        ``polling_mode=False`` makes a consumer that asks too early block the (single-threaded)
        controller and then error; keep it True.
        ``layout``: ``"columns"`` (one TransferQueue field per Sample field, token fields as
        jagged tensors) or ``"packed"`` (one bytes record per sample; several times faster,
        opaque to TransferQueue); see ``relax.data.codec``. Stored in the controller's config,
        so attached planes use the same layout.
        ``sampler``: the TransferQueue sampler used by consuming reads (default
        ``IndexOrderSampler``: ``Sample.index`` order, optional whole groups).
        """
        if not ray.is_initialized():
            raise RuntimeError("DataPlane.start needs a running Ray (call ray.init first)")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if num_storage_units < 1:
            raise ValueError("num_storage_units must be >= 1")
        if capacity_samples is not None and capacity_samples < 1:
            raise ValueError("capacity_samples must be >= 1 or None")
        if _controller_exists():
            raise RuntimeError("A TransferQueue controller already runs in this cluster; use DataPlane.attach()")
        need = 1 + num_storage_units
        total = ray.cluster_resources().get("CPU", 0)
        if total < need:
            raise RuntimeError(
                f"TransferQueue reserves 1 Ray CPU for the controller and 1 per storage unit "
                f"({need} in all) but the cluster has {total:g}; start Ray with more logical CPUs "
                f"(e.g. ray.init(num_cpus=16)) or use fewer storage units. tq.init would hang."
            )
        avail = ray.available_resources().get("CPU", 0)
        if avail < need:
            logger.warning("Only %g Ray CPUs are free; TransferQueue needs %d and may wait for them", avail, need)
        conf = {
            "controller": {"polling_mode": bool(polling_mode)},
            "backend": {
                "storage_backend": "SimpleStorage",
                "SimpleStorage": {
                    "num_data_storage_units": int(num_storage_units),
                    "total_storage_size": capacity_samples,
                },
            },
            _CONF_KEY: {"layout": layout},
        }
        final_conf = tq.init(conf)
        controller = ray.get_actor(_CONTROLLER_NAME, namespace=_CONTROLLER_NAMESPACE)
        ray.get(controller.register_sampler.remote(sampler if sampler is not None else IndexOrderSampler()))
        return cls(
            owner=True, partition_prefix=partition_prefix, logprob_dtype=logprob_dtype, layout=layout, config=final_conf
        )

    @classmethod
    def attach(
        cls,
        *,
        partition_prefix: str = "train",
        logprob_dtype: torch.dtype = torch.float32,
        layout: str | None = None,
        timeout_s: float = 60.0,
    ) -> "DataPlane":
        """Connect this process to the running data plane (waits up to ``timeout_s`` for the
        controller to appear). Works from any Ray actor or driver of the same cluster.
        ``layout=None`` uses the layout given to ``start``; the layout is a property of the
        writer and reader of a partition, so an override must use its own ``partition_prefix``."""
        if not ray.is_initialized():
            raise RuntimeError("DataPlane.attach needs a running Ray (ray.init or inside an actor)")
        deadline = time.monotonic() + timeout_s
        while not _controller_exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"No TransferQueue controller found after {timeout_s}s; call DataPlane.start first")
            time.sleep(0.2)
        tq.init()  # attaches: builds this process's client from the controller's stored config
        if layout is None:
            controller = ray.get_actor(_CONTROLLER_NAME, namespace=_CONTROLLER_NAMESPACE)
            conf = ray.get(controller.get_config.remote())
            ours = conf.get(_CONF_KEY) if conf is not None else None
            layout = ours.get("layout", "columns") if ours is not None else "columns"
        return cls(owner=False, partition_prefix=partition_prefix, logprob_dtype=logprob_dtype, layout=layout)

    def actors(self) -> dict[str, Any]:
        """The owner's TransferQueue actors by name ("data plane controller", "data plane storage unit N"), for
        the HealthManager to probe (they send no heartbeats of their own). TransferQueue keeps their handles in
        module globals of the process that started it; an attached handle has none."""
        if not self._owner:
            return {}
        out: dict[str, Any] = {}
        if _tq_interface._TQ_CONTROLLER is not None:
            out["data plane controller"] = _tq_interface._TQ_CONTROLLER
        units = (_tq_interface._TQ_STORAGE or {}).get("SimpleStorage") or {}
        for i, handle in enumerate(units.values()):
            out[f"data plane storage unit {i}"] = handle
        return out

    def shutdown(self) -> None:
        """Owner: stop storage units and controller (every attached client becomes unusable).
        Attached: close this process's client (when no other handle in the process uses it).
        Idempotent."""
        global _live_handles
        if self._closed:
            return
        self._closed = True
        _live_handles -= 1
        if self._owner:
            tq.close()
            _live_handles = 0
        elif _live_handles == 0:
            # Not tq.close(): in an attached process it would ray.kill the shared controller.
            client = _tq_interface._TQ_CLIENT
            if client is not None:
                try:
                    client.close()
                finally:
                    _tq_interface._TQ_CLIENT = None
                    _tq_interface._TQ_CONTROLLER = None

    def __enter__(self) -> "DataPlane":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    @property
    def is_owner(self) -> bool:
        return self._owner

    @property
    def layout(self) -> str:
        return self._layout

    @property
    def partition_prefix(self) -> str:
        return self._prefix

    @property
    def config(self) -> Any:
        """The merged TransferQueue config (owner only; None when attached)."""
        return self._config

    # ------------------------------------------------------------------ naming
    def partition_id(self, step: int) -> str:
        return f"{self._prefix}_{int(step)}"

    def _step_of(self, partition_id: str) -> int | None:
        head, _, tail = partition_id.rpartition("_")
        if head != self._prefix:
            return None
        try:
            return int(tail)
        except ValueError:
            return None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("DataPlane is shut down")

    # ------------------------------------------------------------------ writes
    def put(self, step: int, samples: Sequence[Sample]) -> int:
        """Append ``samples`` to step ``step``'s partition. Returns the number written.

        All-or-nothing: on failure the samples this call allocated are removed again and the
        error is re-raised."""
        self._check_open()
        if not samples:
            return 0
        staged = sorted({f for s in samples for f in STAGE_FIELDS if getattr(s, f) is not None})
        if staged:
            raise ValueError(f"put writes the rollout fields; stage fields {staged} are added with put_fields")
        if self._layout == "packed":
            td = encode_records(samples, logprob_dtype=self._logprob_dtype)
        else:
            td = encode_samples(samples, logprob_dtype=self._logprob_dtype)
        pid = self.partition_id(step)
        meta = self._client.get_meta(
            data_fields=list(td.keys()), batch_size=len(samples), partition_id=pid, mode="insert"
        )
        try:
            # Order keys for IndexOrderSampler, registered before the data becomes visible
            # (TQ's put sets custom_meta only after marking the samples ready).
            meta.update_custom_meta([{"index": s.index, "group": s.group_index} for s in samples])
            self._client.set_custom_meta(meta)
            self._client.put(td, metadata=meta)
        except BaseException:
            try:
                self._force_clear(meta)
            except Exception:  # keep the original error
                logger.exception("Rolling back a failed put to %s failed", pid)
            raise
        return len(samples)

    # ------------------------------------------------------------------ reads
    def get(
        self,
        step: int,
        batch_size: int | None = None,
        fields: Iterable[str] | None = None,
        task_name: str = "train",
        *,
        group_size: int | None = None,
        timeout_s: float = 0.0,
        poll_interval_s: float = 0.02,
    ) -> list[Sample]:
        """Read samples of step ``step``, sorted by ``Sample.index``.

        ``batch_size=None``: every fully-written sample of the step, without consuming.
        ``batch_size=k``: the next ``k`` samples not yet consumed by ``task_name`` (marks them
        consumed), lowest ``Sample.index`` first; ``[]`` if fewer than ``k`` are ready within
        ``timeout_s``. With ``group_size=n`` only whole groups (``n`` samples sharing
        ``group_index``) are returned and ``k`` must be a multiple of ``n``. (Ordering and
        groups need the default ``IndexOrderSampler``.)
        ``fields``: Sample fields to read (``index`` is always read; default: the rollout fields);
        others keep defaults. Stage fields are read only when named.
        """
        self._check_open()
        names = check_fields(fields) if fields is not None else ROLLOUT_FIELDS
        if "index" not in names:
            names = ("index",) + names
        pid = self.partition_id(step)
        stored = self._storage_fields(names)
        if batch_size is None:
            meta = self._partition_meta(pid, stored)
            staged = [f for f in names if f in STAGE_FIELDS]
            if staged:
                self._check_complete(step, pid, staged, 0 if meta is None else meta.size)
            if meta is None:
                return []
        else:
            if batch_size < 1:
                raise ValueError("batch_size must be >= 1 or None")
            if group_size is not None and (group_size < 1 or batch_size % group_size):
                raise ValueError(f"batch_size {batch_size} must be a multiple of group_size {group_size}")
            sampling_config = {"group_size": int(group_size)} if group_size else None
            deadline = time.monotonic() + timeout_s
            staged = any(f in STAGE_FIELDS for f in names)
            while True:
                # TransferQueue's sampler ignores fields that no sample of the partition has yet; until then
                # nothing is ready
                if staged and self._partition_meta(pid, stored) is None:
                    if time.monotonic() >= deadline:
                        return []
                    time.sleep(poll_interval_s)
                    continue
                meta = self._client.get_meta(
                    data_fields=stored, batch_size=batch_size, partition_id=pid, mode="fetch", task_name=task_name,
                    sampling_config=sampling_config,
                )
                if meta.size > 0:
                    break
                if time.monotonic() >= deadline:
                    return []
                time.sleep(poll_interval_s)
        data = self._client.get_data(meta)
        samples = decode_samples(data, names)
        samples.sort(key=lambda s: s.index)
        return samples

    def _storage_fields(self, names: Iterable[str]) -> list[str]:
        """TransferQueue fields holding the given Sample fields."""
        names = list(names)
        staged = [f for f in names if f in STAGE_FIELDS]
        if self._layout == "packed":
            return [RECORD_FIELD] + staged
        return [f for f in names if f not in STAGE_FIELDS] + staged

    def _check_complete(self, step: int, pid: str, staged: list[str], have: int) -> None:
        meta = self._partition_meta(pid, self._storage_fields(["index"]))
        stored = 0 if meta is None else meta.size
        if have != stored:
            raise MissingFieldError(f"step {step}: {stored - have} of {stored} stored samples have no "
                                    f"{'/'.join(staged)} (the stage that writes it has not run for them)")

    # ------------------------------------------------------------------ stage fields
    def written_fields(self, step: int) -> list[str]:
        """The stage fields every stored sample of step ``step`` has (in ``STAGE_FIELDS`` order): what
        the stages run so far wrote. A field only some samples have is not listed."""
        self._check_open()
        pid = self.partition_id(step)
        base = self._partition_meta(pid, self._storage_fields(["index"]))
        if base is None:
            return []
        out = []
        for name in STAGE_FIELDS:
            meta = self._partition_meta(pid, self._storage_fields(["index", name]))
            if meta is not None and meta.size == base.size:
                out.append(name)
        return out

    def put_fields(self, step: int, indexes: Sequence[int], **rows: Sequence[Sequence[float]]) -> int:
        """Add stage fields to samples of step ``step`` already stored: ``rows[field][i]`` belongs to
        the sample whose ``Sample.index`` is ``indexes[i]`` (one float per response token). A field
        written again for a sample replaces its row. Returns the number of samples written."""
        self._check_open()
        unknown = sorted(set(rows) - set(STAGE_FIELDS))
        if unknown:
            raise ValueError(f"not stage fields: {unknown}; known: {list(STAGE_FIELDS)}")
        indexes = [int(i) for i in indexes]
        for name, values in rows.items():
            if len(values) != len(indexes):
                raise ValueError(f"{name}: {len(values)} rows for {len(indexes)} samples")
        if not indexes or not rows:
            return 0
        pid = self.partition_id(step)
        meta = self._force_meta(pid, self._storage_fields(["index"]))
        if meta is None:
            raise RuntimeError(f"step {step}: no samples stored; nothing to add {sorted(rows)} to")
        where = {int(m["index"]): pos for pos, m in enumerate(meta.get_all_custom_meta()) if "index" in m}
        missing = [i for i in indexes if i not in where]
        if missing:
            raise RuntimeError(f"step {step}: samples {missing[:8]} are not stored; cannot add {sorted(rows)}")
        if len(set(indexes)) != len(indexes):
            raise ValueError(f"step {step}: a sample index is given twice")
        target = meta.select_samples([where[i] for i in indexes])
        td = TensorDict({name: encode_stage_rows(values, name) for name, values in rows.items()},
                        batch_size=[len(indexes)])
        self._client.put(td, metadata=target)
        return len(indexes)

    def _force_meta(self, pid: str, names: list[str], check_exists: bool = True):
        """BatchMeta of every allocated sample of ``pid`` (written or not), or None if the
        partition does not exist."""
        if check_exists and pid not in self._client.get_partition_list():
            return None
        try:
            return self._client.get_meta(data_fields=names, batch_size=None, partition_id=pid, mode="force_fetch")
        except RuntimeError as e:
            if "not found" in str(e):  # cleared concurrently
                return None
            raise

    def _partition_meta(self, pid: str, names: list[str]):
        """BatchMeta of every sample of ``pid`` with all ``names`` written, or None."""
        meta = self._force_meta(pid, names)
        if meta is None:
            return None
        if any(n not in meta.field_names for n in names):
            return None  # a field no sample of the partition has yet: TransferQueue leaves it out of the status
        ready = [i for i, st in enumerate(meta.production_status.tolist()) if st == 1]
        if not ready:
            return None
        return meta if len(ready) == meta.size else meta.select_samples(ready)

    async def aput(self, step: int, samples: Sequence[Sample]) -> int:
        """``put`` for asyncio code (runs in a worker thread; the client is thread-safe)."""
        return await asyncio.to_thread(self.put, step, samples)

    async def aget(self, step: int, batch_size: int | None = None, fields: Iterable[str] | None = None,
                   task_name: str = "train", *, group_size: int | None = None,
                   timeout_s: float = 0.0) -> list[Sample]:
        """``get`` for asyncio code (runs in a worker thread)."""
        return await asyncio.to_thread(
            self.get, step, batch_size, fields, task_name, group_size=group_size, timeout_s=timeout_s
        )

    # ------------------------------------------------------------------ bookkeeping
    def size(self, step: int) -> int:
        """Number of fully-written samples held for ``step``."""
        self._check_open()
        meta = self._partition_meta(self.partition_id(step), self._storage_fields(ROLLOUT_FIELDS))
        return 0 if meta is None else meta.size

    def steps(self) -> list[int]:
        """Steps that currently have a partition (sorted)."""
        self._check_open()
        steps = [self._step_of(p) for p in self._client.get_partition_list()]
        return sorted(s for s in steps if s is not None)

    def clear(self, step: int) -> None:
        """Free step ``step``'s partition (storage and controller). No-op if absent."""
        self._check_open()
        pid = self.partition_id(step)
        meta = self._force_meta(pid, [])
        if meta is None:
            return
        if meta.size == 0:
            # TQ's clear_partition skips a partition without samples and leaves it listed.
            self._client._run_coroutine(self._client._clear_partition_in_controller(pid))
            return
        try:
            self._client.clear_partition(pid)
        except RuntimeError:
            # e.g. allocated-but-never-written indexes make TQ's mark_clearing raise IndexError
            logger.warning("clear_partition(%s) failed; clearing storage and controller directly", pid)
            self._force_clear(meta)
            self._client._run_coroutine(self._client._clear_partition_in_controller(pid))

    def _force_clear(self, meta) -> None:
        """Remove ``meta``'s samples from the storage units and the controller without TQ's
        mark_clearing step (private TransferQueue 0.1.11 client methods)."""
        client = self._client
        client._run_coroutine(client.storage_manager.clear_data(meta))
        client._run_coroutine(client._clear_meta_in_controller(meta))

    def stats(self) -> dict[str, Any]:
        """``{"num_partitions", "num_samples", "samples_per_step": {step: n}}`` for this
        plane's prefix."""
        self._check_open()
        per_step = {}
        for pid in self._client.get_partition_list():
            step = self._step_of(pid)
            if step is None:
                continue
            meta = self._force_meta(pid, self._storage_fields(["index"]), check_exists=False)
            if meta is not None:
                per_step[step] = int((meta.production_status == 1).sum()) if meta.size else 0
        return {
            "num_partitions": len(per_step),
            "num_samples": sum(per_step.values()),
            "samples_per_step": dict(sorted(per_step.items())),
        }
