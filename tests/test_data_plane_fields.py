"""Stage fields on the data plane: a stage adds its per-sample rows to samples already stored (real Ray and
TransferQueue, both layouts)."""

import os
import random
import struct

os.environ.setdefault("TQ_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import shared_ray  # noqa: E402
from test_data_plane import make_samples  # noqa: E402

from relax.data.codec import decode_stage_rows, encode_stage_rows  # noqa: E402
from relax.data.plane import DataPlane, MissingFieldError  # noqa: E402
from relax.data.sample import STAGE_FIELDS  # noqa: E402


@pytest.fixture(scope="module")
def owner():
    shared_ray()
    dp = DataPlane.start(num_storage_units=2, capacity_samples=200)
    try:
        yield dp
    finally:
        dp.shutdown()


@pytest.fixture(scope="module", params=["columns", "packed"])
def plane(request, owner):
    if request.param == "columns":
        yield owner
    else:
        dp = DataPlane.attach(partition_prefix="packedfields", layout="packed", timeout_s=5)
        yield dp
        dp.shutdown()


@pytest.fixture
def dp(plane):
    yield plane
    for step in plane.steps():
        plane.clear(step)


def _rows(samples, seed):
    rng = random.Random(seed)
    return [torch.tensor([rng.gauss(0, 3) for _ in s.response_tokens], dtype=torch.float32) for s in samples]


def test_codec_rows_exact_for_float32():
    rows = [torch.randn(n, dtype=torch.float32) for n in (0, 1, 7)]
    back = decode_stage_rows(encode_stage_rows(rows), 3)
    assert [torch.tensor(b, dtype=torch.float32).tolist() for b in back] == [r.tolist() for r in rows]
    assert decode_stage_rows(encode_stage_rows([r.tolist() for r in rows]), 3) == [r.tolist() for r in rows]


def test_stages_add_fields_to_stored_samples(dp):
    samples = make_samples(12, step=2)
    dp.put(2, samples)
    assert all(getattr(s, f) is None for s in dp.get(2) for f in STAGE_FIELDS)
    with pytest.raises(MissingFieldError, match="12 of 12 stored samples have no ref_logprobs"):
        dp.get(2, fields=["index", "ref_logprobs"])
    ref = _rows(samples, 1)
    # two data-parallel ranks write their shares, in any order
    dp.put_fields(2, [s.index for s in samples[1::2]], ref_logprobs=ref[1::2])
    with pytest.raises(MissingFieldError, match="6 of 12"):
        dp.get(2, fields=["ref_logprobs"])
    dp.put_fields(2, [s.index for s in samples[0::2]][::-1], ref_logprobs=ref[0::2][::-1])
    adv, ret = _rows(samples, 2), _rows(samples, 3)
    dp.put_fields(2, [s.index for s in samples], advantages=adv, returns=ret)
    back = dp.get(2, fields=["index", "response_tokens", "ref_logprobs", "advantages", "returns"])
    assert [s.index for s in back] == [s.index for s in samples]
    for s, r, a, t, orig in zip(back, ref, adv, ret, samples):
        assert s.response_tokens == orig.response_tokens and s.loss_mask == []  # not read
        assert struct.pack(f"{len(r)}f", *s.ref_logprobs) == r.numpy().tobytes()  # bit-exact
        assert s.advantages == a.tolist() and s.returns == t.tolist() and s.values is None
    # the whole sample plus a field; a field written again replaces the row
    dp.put_fields(2, [samples[0].index], ref_logprobs=[[0.5] * len(samples[0].response_tokens)])
    full = dp.get(2, fields=None)
    assert full[0].ref_logprobs is None  # fields=None reads the rollout fields only
    assert dp.get(2, fields=["ref_logprobs"])[0].ref_logprobs == [0.5] * len(samples[0].response_tokens)
    assert dp.size(2) == 12


def test_put_fields_refuses_unknown_samples_and_fields(dp):
    samples = make_samples(4, step=3)
    with pytest.raises(RuntimeError, match="no samples stored"):
        dp.put_fields(3, [0], values=[[1.0]])
    dp.put(3, samples)
    with pytest.raises(RuntimeError, match=r"samples \[99\] are not stored"):
        dp.put_fields(3, [99], values=[[1.0]])
    with pytest.raises(ValueError, match="not stage fields"):
        dp.put_fields(3, [0], reward=[[1.0]])
    with pytest.raises(ValueError, match="rows for"):
        dp.put_fields(3, [0, 1], values=[[1.0]])
    staged = make_samples(1, step=3, start=10)
    staged[0].values = [1.0]
    with pytest.raises(ValueError, match="added with put_fields"):
        dp.put(3, staged)
    dp.clear(3)
    assert dp.steps() == []
