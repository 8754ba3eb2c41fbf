"""Encode ``Sample`` batches to TensorDicts for TransferQueue and back, losslessly.

Two layouts:

* ``"columns"`` (``encode_samples``): one TransferQueue field per ``Sample`` field, token
  fields as jagged tensors. Other TransferQueue consumers can read the fields, and a read
  can transfer only some fields. Slow: TransferQueue moves every per-sample tensor as its
  own message part (measured ~20-40 us per sample per tensor field on 2 cores).
* ``"packed"`` (``encode_records``): a single field ``record`` holding one bytes value per
  sample: a pickle of the field values with the token lists as ``array.array`` (raw int32 /
  float32 / int8 buffers). Several times faster end to end; the fields are opaque to
  TransferQueue and a field-subset read still transfers whole records.

Column layout (one TransferQueue field per ``Sample`` field, same name):

=====================  =========================================  =====================
kind                   fields                                     stored as
=====================  =========================================  =====================
int scalar             index, group_index, weight_version,        int64 tensor [B]
                       rollout_step
float scalar           reward                                     float64 tensor [B]
token-aligned lists    prompt_tokens, response_tokens (int32),    jagged nested tensor
                       loss_mask (int8), response_logprobs        [B, j] (one flat buffer
                       (float32 by default, see below)            + offsets)
text                   response_text, status                      NonTensorStack of str
python objects         prompt, label, raw_reward, metadata,       NonTensorStack of pickle
                       rollout_routed_experts                     bytes
=====================  =========================================  =====================

Why pickle for the object fields (both layouts): TransferQueue keeps non-tensor values through msgpack,
which turns tuples into lists (measured: ``{2: (1, 2)}`` comes back as ``{2: [1, 2]}``) and
falls back to pickle only for unknown types. Pickling ourselves makes the round trip exact
for any picklable value (tuples, int keys, numpy scalars, nested dicts). The cost is that
other TransferQueue consumers see these four fields as opaque bytes; ``decode_columns`` turns
them back. Pickle is only safe between trusted processes (the same trust boundary as Ray).

Log-probs: stored as float32 (the engine's native precision) by default, which makes the
round trip bit-exact for values produced by a float32 engine. A Python float that is not
exactly representable in float32 would be rounded; ``encode_samples`` detects that and warns
once per process. Pass ``logprob_dtype=torch.float64`` to keep arbitrary doubles exact. Keep
one dtype per partition: TransferQueue cannot re-batch mixed dtypes as a jagged tensor and
its strided fallback silently casts everything to the first sample's dtype (measured).

Token ids must fit int32 and ``loss_mask`` values int8; out-of-range values raise
``OverflowError`` instead of wrapping.

Stage fields (``relax.data.sample.STAGE_FIELDS``: old/ref/teacher log-probs, values, advantages, returns),
in both layouts: one TransferQueue field per stage field, a bytes value per sample (the row as float32, the
precision the trainers compute it in, so the round trip is exact for their rows). They are written after
the rollout fields, by the stage that computes them, for samples already stored (``encode_stage_rows``,
``DataPlane.put_fields``); a separate field per stage is what lets a stage add its result without
rewriting the sample's record. Cost against the record alone: benchmarks/data_plane_fields_bench.py.
"""

from __future__ import annotations

import array
import itertools
import logging
import pickle
from typing import Any, Iterable, Sequence

import torch

from relax.data import tensordict_import

tensordict_import.install()  # tensordict without torch._dynamo (see the module)

from tensordict import NonTensorStack, TensorDict  # noqa: E402

from relax.data.sample import ROLLOUT_FIELDS, SAMPLE_FIELDS, STAGE_FIELDS, Sample, check_fields, columns_to_samples  # noqa: E402,E501

logger = logging.getLogger(__name__)

INT_SCALAR_FIELDS = ("index", "group_index", "weight_version", "rollout_step")
FLOAT_SCALAR_FIELDS = ("reward",)
JAGGED_FIELDS = ("prompt_tokens", "response_tokens", "loss_mask", "response_logprobs")
TEXT_FIELDS = ("response_text", "status")
OBJECT_FIELDS = ("prompt", "label", "raw_reward", "metadata", "rollout_routed_experts")

_JAGGED_DTYPES = {
    "prompt_tokens": torch.int32,
    "response_tokens": torch.int32,
    "loss_mask": torch.int8,
}
# array.array type codes (checked sizes below); building arrays from Python lists is ~4x
# faster than torch.tensor(list).
_TYPECODES = {torch.int32: "i", torch.int8: "b", torch.float32: "f", torch.float64: "d"}
assert array.array("i").itemsize == 4 and array.array("b").itemsize == 1 and array.array("f").itemsize == 4

RECORD_FIELD = "record"

assert set(INT_SCALAR_FIELDS + FLOAT_SCALAR_FIELDS + JAGGED_FIELDS + TEXT_FIELDS + OBJECT_FIELDS) == set(
    ROLLOUT_FIELDS
), "every rollout field of Sample needs a storage kind"
assert set(ROLLOUT_FIELDS + STAGE_FIELDS) == set(SAMPLE_FIELDS)

_warned_lossy_logprobs = False


def _jagged(lists: Sequence[Sequence[Any]], dtype: torch.dtype, check_precision: bool = False) -> torch.Tensor:
    """Build a jagged nested tensor [B, j] from per-sample lists with one flat buffer."""
    lengths = [len(x) for x in lists]
    values = list(itertools.chain.from_iterable(lists))
    buf = array.array(_TYPECODES[dtype], values)
    if check_precision:
        _check_rounding(buf, values)
    flat = torch.frombuffer(buf, dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype)
    offsets = torch.zeros(len(lists) + 1, dtype=torch.int64)
    if lengths:
        torch.cumsum(torch.tensor(lengths, dtype=torch.int64), dim=0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(flat, offsets)


def _check_rounding(stored: array.array, original: Sequence[float]) -> None:
    """Warn (once per process) if storing ``original`` as ``stored`` (float32) rounded a value."""
    global _warned_lossy_logprobs
    if _warned_lossy_logprobs or stored.typecode == "d":
        return
    back = stored.tolist()
    if back == original:  # fast path (C-level list compare); NaNs fall through to the slow path
        return
    if any(a != b and not (a != a and b != b) for a, b in zip(back, original)):
        _warned_lossy_logprobs = True
        logger.warning(
            "response_logprobs contain values not exactly representable in float32; they are "
            "rounded on the data plane. Use logprob_dtype=torch.float64 for a bit-exact round "
            "trip of arbitrary Python floats. (Warning shown once.)"
        )


def encode_samples(
    samples: Sequence[Sample],
    fields: Iterable[str] | None = None,
    logprob_dtype: torch.dtype = torch.float32,
    check_precision: bool = True,
) -> TensorDict:
    """Encode samples as a TensorDict with batch size ``len(samples)`` (default: the rollout fields; stage
    fields only when named, and then every sample must have them)."""
    names = check_fields(fields) if fields is not None else ROLLOUT_FIELDS
    if not samples:
        raise ValueError("encode_samples needs at least one sample")
    _check_logprob_dtype(logprob_dtype)
    cols: dict[str, Any] = {}
    for name in names:
        values = [getattr(s, name) for s in samples]
        if name in INT_SCALAR_FIELDS:
            cols[name] = torch.tensor(values, dtype=torch.int64)
        elif name in FLOAT_SCALAR_FIELDS:
            cols[name] = torch.tensor(values, dtype=torch.float64)
        elif name in JAGGED_FIELDS:
            dtype = logprob_dtype if name == "response_logprobs" else _JAGGED_DTYPES[name]
            cols[name] = _jagged(values, dtype, check_precision and name == "response_logprobs")
        elif name in STAGE_FIELDS:
            cols[name] = encode_stage_rows(values, name)
        elif name in TEXT_FIELDS:
            for v in values:
                if not isinstance(v, str):
                    raise TypeError(f"Sample.{name} must be str, got {type(v).__name__}")
            cols[name] = NonTensorStack(*values)
        else:  # OBJECT_FIELDS
            cols[name] = NonTensorStack(*[pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL) for v in values])
    return TensorDict(cols, batch_size=[len(samples)])


def _check_logprob_dtype(logprob_dtype: torch.dtype) -> None:
    if logprob_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"logprob_dtype must be torch.float32 or torch.float64, got {logprob_dtype}")


def encode_records(
    samples: Sequence[Sample],
    logprob_dtype: torch.dtype = torch.float32,
    check_precision: bool = True,
) -> TensorDict:
    """Packed layout: ``TensorDict({"record": NonTensorStack(bytes per sample)})``."""
    if not samples:
        raise ValueError("encode_records needs at least one sample")
    _check_logprob_dtype(logprob_dtype)
    lp_code = _TYPECODES[logprob_dtype]
    records = []
    for s in samples:
        if not isinstance(s.response_text, str) or not isinstance(s.status, str):
            raise TypeError("Sample.response_text and Sample.status must be str")
        values = []
        for name in ROLLOUT_FIELDS:
            v = getattr(s, name)
            if name in JAGGED_FIELDS:
                code = lp_code if name == "response_logprobs" else _TYPECODES[_JAGGED_DTYPES[name]]
                arr = array.array(code, v)
                if check_precision and name == "response_logprobs":
                    _check_rounding(arr, v)
                v = arr
            elif name in INT_SCALAR_FIELDS:
                v = int(v)
            elif name in FLOAT_SCALAR_FIELDS:
                v = float(v)
            values.append(v)
        records.append(pickle.dumps(tuple(values), protocol=pickle.HIGHEST_PROTOCOL))
    return TensorDict({RECORD_FIELD: NonTensorStack(*records)}, batch_size=[len(samples)])


def encode_stage_rows(rows: Sequence[Sequence[float]], name: str = "stage field") -> NonTensorStack:
    """A stage field's column: one float32 bytes value per sample."""
    out = []
    for row in rows:
        if row is None:
            raise ValueError(f"{name}: a sample has no row")
        if isinstance(row, torch.Tensor):
            out.append(row.detach().to(torch.float32).contiguous().numpy().tobytes())
        else:
            out.append(array.array("f", row).tobytes())
    return NonTensorStack(*out)


def decode_stage_rows(col: Any, batch_size: int) -> list[list[float]]:
    """A stage field's column -> one list of floats per sample."""
    rows = []
    for value in _column_to_list(col, batch_size):
        arr = array.array("f")
        arr.frombytes(bytes(value) if not isinstance(value, bytes) else value)
        rows.append(arr.tolist())
    return rows


def _decode_records(records: list[Any], names: tuple[str, ...]) -> dict[str, list[Any]]:
    positions = [(name, ROLLOUT_FIELDS.index(name)) for name in names]
    out: dict[str, list[Any]] = {name: [] for name in names}
    for rec in records:
        values = pickle.loads(bytes(rec) if not isinstance(rec, bytes) else rec)
        for name, pos in positions:
            v = values[pos]
            out[name].append(v.tolist() if name in JAGGED_FIELDS else v)
    return out


def _column_to_lists(col: Any) -> list[list[Any]]:
    """A per-sample sequence column (jagged/strided nested, dense 2-D, or list of tensors)
    -> list of Python lists."""
    if isinstance(col, torch.Tensor):
        if col.is_nested:
            if col.layout == torch.jagged and getattr(col, "_lengths", None) is None:
                flat = col.values().tolist()
                offs = col.offsets().tolist()
                return [flat[offs[i] : offs[i + 1]] for i in range(len(offs) - 1)]
            return [t.tolist() for t in col.unbind()]
        if col.dim() == 1:  # B samples of length 1 squeezed? keep each as a 1-list
            return [[v] for v in col.tolist()]
        return col.tolist()
    return [t.tolist() if isinstance(t, torch.Tensor) else list(t) for t in col]


def _column_to_scalars(col: Any) -> list[Any]:
    if isinstance(col, torch.Tensor):
        if col.is_nested:
            return [t.reshape(-1)[0].item() for t in col.unbind()]
        return col.reshape(col.shape[0], -1)[:, 0].tolist() if col.dim() > 1 else col.tolist()
    return [t.item() if isinstance(t, torch.Tensor) else t for t in col]


def _column_to_list(col: Any, batch_size: int) -> list[Any]:
    """Non-tensor column -> list of values (handles tensordict's stack/collapsed forms)."""
    if isinstance(col, NonTensorStack):
        values = col.tolist()
    elif hasattr(col, "tolist") and not isinstance(col, (str, bytes)):
        values = col.tolist()
    elif isinstance(col, (list, tuple)):
        values = list(col)
    else:  # a single collapsed value (NonTensorData) shared by the whole batch
        values = [col] * batch_size
    if len(values) != batch_size:
        raise ValueError(f"non-tensor column has {len(values)} values for batch size {batch_size}")
    return values


def decode_columns(td: TensorDict | dict[str, Any], fields: Iterable[str] | None = None) -> dict[str, list[Any]]:
    """TensorDict (as returned by TransferQueue, either layout) -> column dict of plain
    Python values.

    Only the requested ``fields`` (default: every Sample field present in ``td``; every field
    for the packed layout) are decoded.
    """
    keys = list(td.keys())
    batch_size = int(td.batch_size[0]) if isinstance(td, TensorDict) else None
    if RECORD_FIELD in keys:
        col = td[RECORD_FIELD]
        n = batch_size if batch_size is not None else len(col)
        names = check_fields(fields) if fields is not None else ROLLOUT_FIELDS + tuple(
            f for f in STAGE_FIELDS if f in keys)
        out = _decode_records(_column_to_list(col, n), tuple(f for f in names if f in ROLLOUT_FIELDS))
        for name in names:
            if name in STAGE_FIELDS:
                out[name] = decode_stage_rows(td[name], n)
        return out
    names = check_fields(fields) if fields is not None else tuple(f for f in SAMPLE_FIELDS if f in keys)
    out: dict[str, list[Any]] = {}
    for name in names:
        col = td[name]
        if name in STAGE_FIELDS:
            out[name] = decode_stage_rows(col, batch_size if batch_size is not None else len(col))
        elif name in INT_SCALAR_FIELDS or name in FLOAT_SCALAR_FIELDS:
            out[name] = _column_to_scalars(col)
        elif name in JAGGED_FIELDS:
            out[name] = _column_to_lists(col)
        else:
            n = batch_size if batch_size is not None else len(col)
            values = _column_to_list(col, n)
            if name in OBJECT_FIELDS:
                values = [pickle.loads(bytes(v)) for v in values]
            out[name] = values
    return out


def decode_samples(td: TensorDict | dict[str, Any], fields: Iterable[str] | None = None) -> list[Sample]:
    """TensorDict -> list of Samples; fields not decoded keep their defaults."""
    return columns_to_samples(decode_columns(td, fields))
