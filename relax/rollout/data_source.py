"""Prompt data: JSONL / Parquet files -> ``PromptRecord``s, served in epochs.

Files
  ``.jsonl`` / ``.json`` (one JSON object per line; blank lines are ignored) or
  ``.parquet``. Each row becomes a ``PromptRecord``: ``prompt`` from ``input_key``
  (a string or a list of message dicts; required), ``label`` from ``label_key``,
  ``metadata`` from ``metadata_key`` (a dict, or a JSON string of one; ``{}`` when
  absent), ``tools`` from ``tool_key`` (a list, or a JSON string of one),
  ``multimodal`` from ``multimodal_keys`` ({modality: field}; see relax.rollout.multimodal). Keys may
  be dotted paths into nested objects (``"extra_info.question"``) when no column
  has the literal name. ``index`` numbers the good rows of the file from 0, in file
  order, and is stable across epochs, shuffles and resumes.

Bad rows
  A malformed JSON line, a row that is not an object, or a row without a usable
  ``input_key`` raises ``PromptDataError`` naming ``file:line`` (Parquet:
  ``file: row N``), unless ``skip_bad_lines=True``: then it is skipped, counted in
  ``stats()["bad_lines"]`` and logged.

Serving (``PromptDataSource``)
  ``get_batch(n)`` returns ``n`` items: first the groups handed back with
  ``add_back(groups)`` (FIFO, exactly as given), then fresh records, continuing
  into the next epoch when one ends. With ``shuffle=True`` each epoch is a
  permutation seeded by ``rollout_seed + epoch`` (eager mode). ``state_dict()`` /
  ``load_state_dict()`` capture epoch, position, the returned-groups buffer and the
  counters, so a resumed source yields exactly what the original would have.
  Eager mode hands out deep copies, so mutating a served record's metadata does
  not leak into later epochs.

  Streaming (``streaming=True``) reads the file lazily, ``buffer_size`` records at
  a time (flat memory, for files of millions of lines). With shuffle on, records
  are shuffled within each block of ``buffer_size`` (seed: ``rollout_seed``, epoch,
  block number); with shuffle off the order equals eager mode's. Its state holds
  the byte offset (Parquet: row number) of the current block. Bad rows in
  streaming mode are found when reached, not up front.

Filtering
  With a ``prompt_encoder`` (``relax.rollout.prompts.PromptEncoder`` with
  ``max_prompt_len``), prompts that do not fit are dropped and counted in
  ``stats()["filtered_long_prompts"]`` (eager: at load; streaming: when first
  read).
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

__all__ = [
    "PromptRecord",
    "PromptDataError",
    "PromptDataSource",
    "read_prompt_records",
    "count_prompt_records",
]

logger = logging.getLogger(__name__)

STATE_VERSION = 1
_RECORD_MARK = "__prompt_record__"


class PromptDataError(ValueError):
    """A prompt file or row is unusable; the message names the file and line/row."""


@dataclass(frozen=True)
class PromptRecord:
    index: int
    prompt: Union[str, list]
    label: Any = None
    metadata: dict = field(default_factory=dict)
    tools: Optional[list] = None
    multimodal: Optional[dict] = None  # {modality: value} from --multimodal-keys

    def to_dict(self) -> dict:
        return {"index": self.index, "prompt": self.prompt, "label": self.label, "metadata": self.metadata,
                "tools": self.tools, "multimodal": self.multimodal}

    @classmethod
    def from_dict(cls, d: dict) -> "PromptRecord":
        return cls(index=int(d["index"]), prompt=d["prompt"], label=d.get("label"), metadata=dict(d.get("metadata") or {}),
                   tools=d.get("tools"), multimodal=d.get("multimodal"))


# --------------------------------------------------------------------------- rows


class _BadRow(Exception):
    pass


_MISSING = object()


def _lookup(row: dict, key: Optional[str]) -> Any:
    if key is None:
        return _MISSING
    if key in row:
        return row[key]
    if "." in key:
        cur: Any = row
        for part in key.split("."):
            if isinstance(cur, dict) and part in cur:
                cur = cur[part]
            else:
                return _MISSING
        return cur
    return _MISSING


def _maybe_json(value: Any, what: str, want: type) -> Any:
    if isinstance(value, str):
        s = value.strip()
        if not s:
            return None
        try:
            value = json.loads(s)
        except json.JSONDecodeError as e:
            raise _BadRow(f"{what} is a string that is not valid JSON: {e}") from None
    if value is not None and not isinstance(value, want):
        raise _BadRow(f"{what} must be a {want.__name__}, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class _Keys:
    input_key: str
    label_key: Optional[str]
    metadata_key: Optional[str]
    tool_key: Optional[str]
    multimodal_keys: Optional[tuple] = None  # ((modality, field), ...)


def _row_to_record(row: Any, index: int, keys: _Keys) -> PromptRecord:
    if not isinstance(row, dict):
        raise _BadRow(f"row is not a JSON object (got {type(row).__name__})")
    prompt = _lookup(row, keys.input_key)
    if prompt is _MISSING or prompt is None:
        raise _BadRow(f"missing input key {keys.input_key!r}")
    if isinstance(prompt, tuple):
        prompt = list(prompt)
    if isinstance(prompt, list):
        if not all(isinstance(m, dict) for m in prompt):
            raise _BadRow(f"input key {keys.input_key!r}: a list prompt must hold message objects")
    elif not isinstance(prompt, str):
        raise _BadRow(f"input key {keys.input_key!r} must be a string or a list of messages, got {type(prompt).__name__}")
    label = _lookup(row, keys.label_key)
    label = None if label is _MISSING else label
    md = _lookup(row, keys.metadata_key)
    md = {} if md is _MISSING else (_maybe_json(md, f"metadata key {keys.metadata_key!r}", dict) or {})
    tools = _lookup(row, keys.tool_key)
    tools = None if tools is _MISSING else _maybe_json(tools, f"tool key {keys.tool_key!r}", list)
    multimodal = {}
    for modality, key in keys.multimodal_keys or ():
        value = _lookup(row, key)
        if value is not _MISSING and value is not None:
            multimodal[modality] = value
    return PromptRecord(index=index, prompt=prompt, label=label, metadata=dict(md), tools=tools,
                        multimodal=multimodal or None)


def _file_format(path: str) -> str:
    low = path.lower()
    if low.endswith(".parquet"):
        return "parquet"
    if low.endswith(".jsonl") or low.endswith(".json") or low.endswith(".ndjson"):
        return "jsonl"
    raise PromptDataError(f"{path}: unsupported prompt file type (use .jsonl or .parquet)")


def _iter_raw(path: str, fmt: str, offset: int, lineno: int) -> Iterator[tuple[int, Any, Optional[str], int]]:
    """Yield ``(lineno, row, parse_error, next_offset)`` from ``offset``.

    JSONL: ``offset`` is a byte offset and ``lineno`` counts lines read so far.
    Parquet: both are the number of rows before ``offset``.
    Blank JSONL lines are skipped (no yield) but advance the line number.
    """
    if fmt == "jsonl":
        with open(path, "rb") as f:
            f.seek(offset)
            while True:
                raw = f.readline()
                if not raw:
                    return
                lineno += 1
                nxt = f.tell()
                try:
                    text = raw.decode("utf-8").strip()
                except UnicodeDecodeError as e:
                    yield lineno, None, f"invalid UTF-8: {e}", nxt
                    continue
                if not text:
                    continue
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as e:
                    yield lineno, None, f"malformed JSON: {e}", nxt
                    continue
                yield lineno, row, None, nxt
    else:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        md = pf.metadata
        start_rg, rg_first_row = 0, 0
        while start_rg < md.num_row_groups and rg_first_row + md.row_group(start_rg).num_rows <= offset:
            rg_first_row += md.row_group(start_rg).num_rows
            start_rg += 1
        if start_rg >= md.num_row_groups:
            return
        row_no = rg_first_row
        for batch in pf.iter_batches(batch_size=1024, row_groups=list(range(start_rg, md.num_row_groups))):
            rows = batch.to_pylist()
            for row in rows:
                if row_no >= offset:
                    yield row_no + 1, row, None, row_no + 1
                row_no += 1


def _where(path: str, fmt: str, lineno: int) -> str:
    return f"{path}:{lineno}" if fmt == "jsonl" else f"{path}: row {lineno}"


@dataclass
class _Cursor:
    offset: int = 0  # byte offset (jsonl) / row number (parquet) of the next unread row
    lineno: int = 0  # lines/rows read before offset
    next_index: int = 0  # good records before offset


class _Reader:
    """Row -> record conversion with bad-row policy and optional length filter."""

    def __init__(self, path: str, keys: _Keys, skip_bad_lines: bool, keep: Optional[Callable[[PromptRecord], bool]]):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"prompt file not found: {self.path}")
        self.fmt = _file_format(self.path)
        self.keys = keys
        self.skip_bad_lines = skip_bad_lines
        self.keep = keep

    def iter_from(self, cur: _Cursor, on_bad: Callable[[int, str], None], on_filtered: Callable[[int], None]) -> Iterator[tuple[PromptRecord, _Cursor]]:
        """Yield ``(record, cursor after it)``; bad and filtered rows call the hooks with their offsets."""
        index = cur.next_index
        for lineno, row, err, nxt in _iter_raw(self.path, self.fmt, cur.offset, cur.lineno):
            rec = None
            if err is None:
                try:
                    rec = _row_to_record(row, index, self.keys)
                except _BadRow as e:
                    err = str(e)
            if err is not None:
                where = _where(self.path, self.fmt, lineno)
                if not self.skip_bad_lines:
                    raise PromptDataError(f"{where}: {err}")
                logger.warning("skipping bad prompt row %s: %s", where, err)
                on_bad(nxt)
                continue
            index += 1  # a good row gets an index even when filtered out, so indices match the file
            if self.keep is not None and not self.keep(rec):
                on_filtered(nxt)
                continue
            yield rec, _Cursor(nxt, lineno, index)


def _keys(input_key: str, label_key: Optional[str], metadata_key: Optional[str], tool_key: Optional[str],
          multimodal_keys: Optional[dict] = None) -> _Keys:
    if not input_key:
        raise ValueError("input_key is required")
    return _Keys(input_key, label_key, metadata_key, tool_key,
                 tuple(sorted(multimodal_keys.items())) if multimodal_keys else None)


def scan_prompt_file(
    path: str,
    *,
    input_key: str = "prompt",
    label_key: Optional[str] = "label",
    metadata_key: Optional[str] = "metadata",
    tool_key: Optional[str] = "tools",
    skip_bad_lines: bool = False,
    multimodal_keys: Optional[dict] = None,
    max_rows: Optional[int] = None,
) -> dict:
    """Read up to `max_rows` rows as training would (same parser, same bad-row policy) and count what
    matters before a run starts: ``{"rows", "bad_lines", "missing_label", "distinct_prompts",
    "complete"}`` (`complete`: the whole file was read). A bad row raises `PromptDataError` naming
    file:line unless `skip_bad_lines`."""
    reader = _Reader(path, _keys(input_key, label_key, metadata_key, tool_key, multimodal_keys), skip_bad_lines, None)
    counts = {"rows": 0, "bad_lines": 0, "missing_label": 0, "complete": True}
    prompts: set[str] = set()

    def bad(_: int) -> None:
        counts["bad_lines"] += 1

    for rec, _ in reader.iter_from(_Cursor(), bad, lambda _: None):
        if max_rows is not None and counts["rows"] >= max_rows:
            counts["complete"] = False
            break
        counts["rows"] += 1
        counts["missing_label"] += int(label_key is not None and rec.label is None)
        prompts.add(json.dumps(rec.prompt, sort_keys=True) if not isinstance(rec.prompt, str) else rec.prompt)
    counts["distinct_prompts"] = len(prompts)
    return counts


def read_prompt_records(
    path: str,
    *,
    input_key: str = "prompt",
    label_key: Optional[str] = "label",
    metadata_key: Optional[str] = "metadata",
    tool_key: Optional[str] = "tools",
    skip_bad_lines: bool = False,
    keep: Optional[Callable[[PromptRecord], bool]] = None,
    multimodal_keys: Optional[dict] = None,
) -> tuple[list[PromptRecord], dict]:
    """All records of a file and ``{"bad_lines": n, "filtered_long_prompts": m}``."""
    reader = _Reader(path, _keys(input_key, label_key, metadata_key, tool_key, multimodal_keys), skip_bad_lines, keep)
    counts = {"bad_lines": 0, "filtered_long_prompts": 0}

    def bad(_: int) -> None:
        counts["bad_lines"] += 1

    def filtered(_: int) -> None:
        counts["filtered_long_prompts"] += 1

    records = [rec for rec, _ in reader.iter_from(_Cursor(), bad, filtered)]
    return records, counts


def count_prompt_records(path: str, **kwargs: Any) -> int:
    """Number of usable records (one streaming pass, flat memory)."""
    kw = dict(kwargs)
    reader = _Reader(
        path,
        _keys(kw.pop("input_key", "prompt"), kw.pop("label_key", "label"), kw.pop("metadata_key", "metadata"), kw.pop("tool_key", "tools")),
        kw.pop("skip_bad_lines", False),
        kw.pop("keep", None),
    )
    if kw:
        raise TypeError(f"unexpected arguments: {sorted(kw)}")
    return sum(1 for _ in reader.iter_from(_Cursor(), lambda _o: None, lambda _o: None))


# --------------------------------------------------------------------------- data source


def _encode_item(item: Any) -> Any:
    if isinstance(item, PromptRecord):
        return {_RECORD_MARK: item.to_dict()}
    if isinstance(item, list):
        return [_encode_item(x) for x in item]
    return item


def _decode_item(item: Any) -> Any:
    if isinstance(item, dict) and set(item) == {_RECORD_MARK}:
        return PromptRecord.from_dict(item[_RECORD_MARK])
    if isinstance(item, list):
        return [_decode_item(x) for x in item]
    return item


class PromptDataSource:
    """Serves prompt records in epochs; see the module docstring."""

    def __init__(
        self,
        path: str,
        *,
        input_key: str = "prompt",
        label_key: Optional[str] = "label",
        metadata_key: Optional[str] = "metadata",
        tool_key: Optional[str] = "tools",
        shuffle: bool = False,
        rollout_seed: int = 42,
        skip_bad_lines: bool = False,
        prompt_encoder: Any = None,
        streaming: bool = False,
        buffer_size: int = 10000,
        multimodal_keys: Optional[dict] = None,
    ) -> None:
        if buffer_size <= 0:
            raise ValueError(f"buffer_size must be positive, got {buffer_size}")
        self.path = os.fspath(path)
        self.shuffle = bool(shuffle)
        self.rollout_seed = int(rollout_seed)
        self.streaming = bool(streaming)
        self.buffer_size = int(buffer_size)
        self.prompt_encoder = prompt_encoder
        keep = None
        if prompt_encoder is not None and getattr(prompt_encoder, "max_prompt_len", None) is not None:
            keep = prompt_encoder.fits
        self._reader = _Reader(self.path, _keys(input_key, label_key, metadata_key, tool_key, multimodal_keys),
                               skip_bad_lines, keep)
        self._buffer: collections.deque = collections.deque()
        self._counts = {"bad_lines": 0, "filtered_long_prompts": 0}
        self.epoch = 0
        # eager state
        self._records: list[PromptRecord] = []
        self._order: Optional[np.ndarray] = None
        self._position = 0
        # streaming state
        self._block_start = _Cursor()
        self._block_end: Optional[_Cursor] = None
        self._block_no = 0
        self._block: Optional[list[PromptRecord]] = None
        self._block_perm: Optional[np.ndarray] = None
        self._count_hwm = -1  # streaming: rows at offsets <= this (in epoch 0) are already counted
        self._num_prompts: Optional[int] = None

        if not self.streaming:
            self._records, counts = self._load_all()
            self._counts.update(counts)
            self._num_prompts = len(self._records)

    @classmethod
    def from_args(cls, args: Any, *, prompt_encoder: Any = None, path: Optional[str] = None, **overrides: Any) -> "PromptDataSource":
        """From flags: ``prompt_data``, ``input_key``, ``label_key``, ``metadata_key``, ``tool_key``,
        ``rollout_shuffle``, ``rollout_seed``, ``use_streaming_dataset``, ``streaming_buffer_size``
        (and ``skip_bad_lines`` when present)."""
        path = path or getattr(args, "prompt_data", None)
        if not path:
            raise ValueError("no prompt file: set --prompt-data")
        kw = dict(
            input_key=getattr(args, "input_key", None) or "prompt",
            label_key=getattr(args, "label_key", None),
            metadata_key=getattr(args, "metadata_key", "metadata"),
            tool_key=getattr(args, "tool_key", "tools"),
            shuffle=bool(getattr(args, "rollout_shuffle", False)),
            rollout_seed=int(getattr(args, "rollout_seed", 42) or 0),
            skip_bad_lines=bool(getattr(args, "skip_bad_lines", False)),
            streaming=bool(getattr(args, "use_streaming_dataset", False)),
            buffer_size=int(getattr(args, "streaming_buffer_size", 10000) or 10000),
            prompt_encoder=prompt_encoder,
            multimodal_keys=getattr(args, "multimodal_keys", None),
        )
        kw.update(overrides)
        return cls(path, **kw)

    # ------------------------------------------------------------------ info
    def _load_all(self) -> tuple[list[PromptRecord], dict]:
        counts = {"bad_lines": 0, "filtered_long_prompts": 0}

        def bad(_: int) -> None:
            counts["bad_lines"] += 1

        def filtered(_: int) -> None:
            counts["filtered_long_prompts"] += 1

        return [rec for rec, _ in self._reader.iter_from(_Cursor(), bad, filtered)], counts

    @property
    def num_prompts(self) -> int:
        """Usable prompts per epoch (streaming: one counting pass over the file, cached)."""
        if self._num_prompts is None:
            self._num_prompts = sum(
                1 for _ in self._reader.iter_from(_Cursor(), lambda _o: None, lambda _o: None)
            )
        return self._num_prompts

    def __len__(self) -> int:
        return self.num_prompts

    def num_rollouts_for_epochs(self, num_epoch: int, rollout_batch_size: int) -> int:
        """``--num-rollout`` for ``--num-epoch``: ``num_epoch * num_prompts // rollout_batch_size``."""
        if rollout_batch_size <= 0:
            raise ValueError("rollout_batch_size must be positive")
        return num_epoch * self.num_prompts // rollout_batch_size

    def stats(self) -> dict:
        out = dict(self._counts)
        out.update(epoch=self.epoch, buffered_groups=len(self._buffer))
        if self._num_prompts is not None:
            out["num_prompts"] = self._num_prompts
        return out

    # ------------------------------------------------------------------ buffer
    def add_back(self, groups: Sequence[Any]) -> None:
        """Hand groups back (e.g. aborted partial rollouts); ``get_batch`` serves them first."""
        for g in groups:
            self._buffer.append(g)

    # ------------------------------------------------------------------ serving
    def get_batch(self, n: int) -> list:
        """``n`` items: buffered groups first, then fresh ``PromptRecord``s (across epochs)."""
        if n < 0:
            raise ValueError("n must be >= 0")
        out: list = []
        while len(out) < n and self._buffer:
            out.append(self._buffer.popleft())
        while len(out) < n:
            out.append(self._next_streaming() if self.streaming else self._next_eager())
        return out

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self._records)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng(self.rollout_seed + epoch).permutation(n)

    def _next_eager(self) -> PromptRecord:
        if not self._records:
            raise PromptDataError(f"{self.path}: no usable prompts (bad lines: {self._counts['bad_lines']}, "
                                  f"filtered long prompts: {self._counts['filtered_long_prompts']})")
        if self._position >= len(self._records):
            self.epoch += 1
            self._position = 0
            self._order = None
        if self._order is None:
            self._order = self._epoch_order(self.epoch)
        rec = self._records[int(self._order[self._position])]
        self._position += 1
        # a private copy: callers may mutate metadata (e.g. reward errors) without touching later epochs
        return copy.deepcopy(rec)

    # streaming ---------------------------------------------------------
    def _count_bad(self, offset: int) -> None:
        if self.epoch == 0 and offset > self._count_hwm:
            self._counts["bad_lines"] += 1
            self._count_hwm = offset

    def _count_filtered(self, offset: int) -> None:
        if self.epoch == 0 and offset > self._count_hwm:
            self._counts["filtered_long_prompts"] += 1
            self._count_hwm = offset

    def _load_block(self) -> None:
        block: list[PromptRecord] = []
        end = self._block_start
        for rec, cur in self._reader.iter_from(self._block_start, self._count_bad, self._count_filtered):
            block.append(rec)
            end = cur
            if self.epoch == 0:
                self._count_hwm = max(self._count_hwm, cur.offset)
            if len(block) >= self.buffer_size:
                break
        else:
            # reached EOF: rows after the last record (bad/filtered/blank) are consumed too
            end = _Cursor(offset=-1, lineno=end.lineno, next_index=end.next_index)
        self._block = block
        self._block_end = end
        if self.shuffle:
            seed = [self.rollout_seed, self.epoch, self._block_no]
            self._block_perm = np.random.default_rng(seed).permutation(len(block))
        else:
            self._block_perm = np.arange(len(block))

    def _next_streaming(self) -> PromptRecord:
        while True:
            if self._block is None:
                self._load_block()
            assert self._block is not None and self._block_perm is not None and self._block_end is not None
            if self._position < len(self._block):
                rec = self._block[int(self._block_perm[self._position])]
                self._position += 1
                return rec
            # block exhausted: next block, or next epoch at EOF
            if self._block_end.offset == -1:
                if self._block_no == 0 and not self._block:  # block 0 starts at the top of the file
                    raise PromptDataError(f"{self.path}: no usable prompts (bad lines: {self._counts['bad_lines']}, "
                                          f"filtered long prompts: {self._counts['filtered_long_prompts']})")
                self.epoch += 1
                self._block_start = _Cursor()
                self._block_no = 0
            else:
                self._block_start = self._block_end
                self._block_no += 1
            self._block = None
            self._position = 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything needed to continue exactly (JSON-serializable when the buffer holds only records)."""
        state = {
            "version": STATE_VERSION,
            "mode": "streaming" if self.streaming else "eager",
            "path": self.path,
            "shuffle": self.shuffle,
            "rollout_seed": self.rollout_seed,
            "epoch": self.epoch,
            "position": self._position,
            "buffer": [_encode_item(g) for g in self._buffer],
            "counts": dict(self._counts),
        }
        if self.streaming:
            state.update(
                offset=self._block_start.offset,
                lineno=self._block_start.lineno,
                next_index=self._block_start.next_index,
                block_no=self._block_no,
                buffer_size=self.buffer_size,
                count_hwm=self._count_hwm,
            )
        else:
            state["num_prompts"] = len(self._records)
        return state

    def load_state_dict(self, state: dict) -> None:
        mode = "streaming" if self.streaming else "eager"
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported data source state version {state.get('version')!r}")
        if state.get("mode") != mode:
            raise ValueError(f"state is for a {state.get('mode')} data source, this one is {mode}")
        for key, mine in (("shuffle", self.shuffle), ("rollout_seed", self.rollout_seed)):
            if state.get(key) != mine:
                raise ValueError(f"cannot resume exactly: state has {key}={state.get(key)!r}, this source has {mine!r}")
        if self.streaming:
            if state.get("buffer_size") != self.buffer_size:
                raise ValueError(f"cannot resume exactly: state has buffer_size={state.get('buffer_size')}, this source has {self.buffer_size}")
            self._block_start = _Cursor(int(state["offset"]), int(state["lineno"]), int(state["next_index"]))
            self._block_no = int(state["block_no"])
            self._count_hwm = int(state.get("count_hwm", -1))
            self._block = None
            self._block_end = None
        else:
            if state.get("num_prompts") != len(self._records):
                raise ValueError(
                    f"cannot resume exactly: state was saved with {state.get('num_prompts')} prompts, "
                    f"{self.path} now has {len(self._records)}"
                )
            self._order = None
        self.epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._buffer = collections.deque(_decode_item(g) for g in state.get("buffer", []))
        self._counts.update(state.get("counts", {}))
