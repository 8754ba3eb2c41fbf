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

The file reader itself (rows -> records, bad rows, counting) is `relax.formats.prompt_files`, shared with
the checks before a run and with config validation; its names are re-exported here.
"""

from __future__ import annotations

import collections
import copy
import logging
import os
from typing import Any, Optional, Sequence

import numpy as np

from relax.formats.prompt_files import (
    Cursor,
    PromptDataError,
    PromptReader,
    PromptRecord,
    count_prompt_records,
    prompt_keys,
    read_prompt_records,
    scan_prompt_file,
)

__all__ = [
    "PromptRecord",
    "PromptDataError",
    "PromptDataSource",
    "read_prompt_records",
    "count_prompt_records",
    "scan_prompt_file",
]

logger = logging.getLogger(__name__)

STATE_VERSION = 1
_RECORD_MARK = "__prompt_record__"


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
        self._reader = PromptReader(self.path, prompt_keys(input_key, label_key, metadata_key, tool_key,
                                                           multimodal_keys), skip_bad_lines, keep)
        self._buffer: collections.deque = collections.deque()
        self._counts = {"bad_lines": 0, "filtered_long_prompts": 0}
        self.epoch = 0
        # eager state
        self._records: list[PromptRecord] = []
        self._order: Optional[np.ndarray] = None
        self._position = 0
        # streaming state
        self._block_start = Cursor()
        self._block_end: Optional[Cursor] = None
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
    def from_args(cls, args: Any, *, prompt_encoder: Any = None, path: Optional[str] = None,
                  **overrides: Any) -> "PromptDataSource":
        """From flags: ``prompt_data``, ``input_key``, ``label_key``, ``metadata_key``, ``tool_key``,
        ``rollout_shuffle``, ``rollout_seed``, ``skip_bad_lines``, ``use_streaming_dataset``,
        ``streaming_buffer_size``, ``multimodal_keys``."""
        path = path or args.prompt_data
        if not path:
            raise ValueError("no prompt file: set --prompt-data")
        kw = dict(
            input_key=args.input_key,
            label_key=args.label_key,
            metadata_key=args.metadata_key,
            tool_key=args.tool_key,
            shuffle=bool(args.rollout_shuffle),
            rollout_seed=int(args.rollout_seed or 0),
            skip_bad_lines=bool(args.skip_bad_lines),
            streaming=bool(args.use_streaming_dataset),
            buffer_size=int(args.streaming_buffer_size),
            prompt_encoder=prompt_encoder,
            multimodal_keys=args.multimodal_keys,
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

        return [rec for rec, _ in self._reader.iter_from(Cursor(), bad, filtered)], counts

    @property
    def num_prompts(self) -> int:
        """Usable prompts per epoch (streaming: one counting pass over the file, cached)."""
        if self._num_prompts is None:
            self._num_prompts = sum(
                1 for _ in self._reader.iter_from(Cursor(), lambda _o: None, lambda _o: None)
            )
        return self._num_prompts

    def __len__(self) -> int:
        return self.num_prompts

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
            end = Cursor(offset=-1, lineno=end.lineno, next_index=end.next_index)
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
                self._block_start = Cursor()
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
            self._block_start = Cursor(int(state["offset"]), int(state["lineno"]), int(state["next_index"]))
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
