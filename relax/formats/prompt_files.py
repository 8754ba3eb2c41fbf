"""Prompt files: JSONL / Parquet rows -> ``PromptRecord``s, with the bad-row policy.

The one reader of prompt files: training serves them through `relax.rollout.data_source.PromptDataSource`,
the checks before a run (`relax.core.preflight`) scan them and config validation counts their usable rows
(`--num-epoch`) with it, so all three agree on what a bad row is. See `relax.rollout.data_source` for the
file format.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

from relax.formats.row_checks import messages_problem

__all__ = [
    "PromptRecord",
    "PromptDataError",
    "RowFlagError",
    "PromptReader",
    "Cursor",
    "prompt_keys",
    "scan_prompt_file",
    "read_prompt_records",
    "count_prompt_records",
]

logger = logging.getLogger("relax.rollout.data_source")


class PromptDataError(ValueError):
    """A prompt file or row is unusable; the message names the file and line/row."""


class RowFlagError(PromptDataError):
    """A row that parses but disagrees with the flags (`relax.formats.row_checks`): --skip-bad-lines does not skip it
    (training would not), the flag must change or the row."""


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
        bad = messages_problem(prompt)
        if bad:
            raise _BadRow(f"input key {keys.input_key!r}: {bad}")
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
class Cursor:
    offset: int = 0  # byte offset (jsonl) / row number (parquet) of the next unread row
    lineno: int = 0  # lines/rows read before offset
    next_index: int = 0  # good records before offset


class PromptReader:
    """Row -> record conversion with bad-row policy and optional length filter."""

    def __init__(self, path: str, keys: _Keys, skip_bad_lines: bool, keep: Optional[Callable[[PromptRecord], bool]]):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"prompt file not found: {self.path}")
        self.fmt = _file_format(self.path)
        self.keys = keys
        self.skip_bad_lines = skip_bad_lines
        self.keep = keep

    def iter_from(self, cur: Cursor, on_bad: Callable[[int, str], None], on_filtered: Callable[[int], None]) -> Iterator[tuple[PromptRecord, Cursor]]:
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
            yield rec, Cursor(nxt, lineno, index)


def prompt_keys(input_key: str, label_key: Optional[str], metadata_key: Optional[str], tool_key: Optional[str],
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
    check: Optional[Callable[[PromptRecord], Any]] = None,
) -> dict:
    """Read up to `max_rows` rows as training would (same parser, same bad-row policy) and count what
    matters before a run starts: ``{"rows", "bad_lines", "missing_label", "distinct_prompts",
    "complete"}`` (`complete`: the whole file was read). A bad row raises `PromptDataError` naming
    file:line unless `skip_bad_lines`; then the first record for which `check` returns a problem (not None)
    raises `RowFlagError` naming file:line and the problem, whatever `skip_bad_lines` says."""
    reader = PromptReader(path, prompt_keys(input_key, label_key, metadata_key, tool_key, multimodal_keys), skip_bad_lines, None)
    counts = {"rows": 0, "bad_lines": 0, "missing_label": 0, "complete": True}
    prompts: set[str] = set()
    first_problem: Optional[str] = None

    def bad(_: int) -> None:
        counts["bad_lines"] += 1

    for rec, cur in reader.iter_from(Cursor(), bad, lambda _: None):
        if max_rows is not None and counts["rows"] >= max_rows:
            counts["complete"] = False
            break
        problem = check(rec) if check is not None and first_problem is None else None
        if problem is not None:
            first_problem = f"{_where(reader.path, reader.fmt, cur.lineno)}: {problem}"
        counts["rows"] += 1
        counts["missing_label"] += int(label_key is not None and rec.label is None)
        prompts.add(json.dumps(rec.prompt, sort_keys=True) if not isinstance(rec.prompt, str) else rec.prompt)
    if first_problem is not None:  # after the scan: a row that does not parse is named first
        raise RowFlagError(first_problem)
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
    reader = PromptReader(path, prompt_keys(input_key, label_key, metadata_key, tool_key, multimodal_keys), skip_bad_lines, keep)
    counts = {"bad_lines": 0, "filtered_long_prompts": 0}

    def bad(_: int) -> None:
        counts["bad_lines"] += 1

    def filtered(_: int) -> None:
        counts["filtered_long_prompts"] += 1

    records = [rec for rec, _ in reader.iter_from(Cursor(), bad, filtered)]
    return records, counts


def count_prompt_records(path: str, **kwargs: Any) -> int:
    """Number of usable records (one streaming pass, flat memory)."""
    kw = dict(kwargs)
    reader = PromptReader(
        path,
        prompt_keys(kw.pop("input_key", "prompt"), kw.pop("label_key", "label"), kw.pop("metadata_key", "metadata"), kw.pop("tool_key", "tools")),
        kw.pop("skip_bad_lines", False),
        kw.pop("keep", None),
    )
    if kw:
        raise TypeError(f"unexpected arguments: {sorted(kw)}")
    return sum(1 for _ in reader.iter_from(Cursor(), lambda _o: None, lambda _o: None))
