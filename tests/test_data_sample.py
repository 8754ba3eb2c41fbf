"""Sample record and its TensorDict codec (no Ray, no TransferQueue)."""

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.data import codec
from relax.data.codec import decode_columns, decode_samples, encode_records, encode_samples
from relax.data.sample import (
    SAMPLE_FIELDS,
    Sample,
    check_fields,
    columns_to_samples,
    samples_to_columns,
)


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def make_samples(n=5):
    out = []
    for i in range(n):
        r = 3 * i  # 0, 3, 6, ... (sample 0 has an empty response)
        out.append(
            Sample(
                index=100 + i,
                group_index=i // 2,
                prompt=[{"role": "user", "content": f"q{i} ünïcødé 🚀"}] if i % 2 else f"prompt {i} — 你好",
                prompt_tokens=list(range(i + 1)),
                response_tokens=[50000 + k for k in range(r)],
                response_logprobs=[f32(-0.1 * (k + 1) / 3) for k in range(r)],
                loss_mask=[1 if k % 4 else 0 for k in range(r)],
                response_text="réponse 🚀" * i,
                label={"answer": (i, "x")},
                reward=0.1 * i - 0.25,
                raw_reward={"acc": 1.0, "fmt": None} if i % 2 else 0.5,
                status=["completed", "truncated", "aborted", "failed"][i % 4],
                weight_version=i,
                metadata={"turns": (1, 2), 7: [None, {"k": b"\x00\xff"}], "t": float("inf")},
                rollout_step=3,
            )
        )
    return out


def test_helpers():
    s = Sample(prompt_tokens=[1, 2], response_tokens=[3, 4, 5], response_logprobs=[0.0] * 3, loss_mask=[1] * 3)
    assert s.tokens == [1, 2, 3, 4, 5]
    assert s.response_length == 3 and s.prompt_length == 2 and s.total_length == 5
    s.validate()
    with pytest.raises(ValueError):
        Sample(response_tokens=[1], loss_mask=[1, 1]).validate()
    Sample(response_tokens=[1]).validate()  # empty logprobs / mask allowed
    with pytest.raises(ValueError):
        Sample(status="done")


def test_dict_and_columns_round_trip():
    samples = make_samples()
    assert Sample.from_dict(samples[1].to_dict()) == samples[1]
    assert list(samples[0].to_dict()) == list(SAMPLE_FIELDS)
    cols = samples_to_columns(samples)
    assert set(cols) == set(SAMPLE_FIELDS) and len(cols["index"]) == 5
    assert columns_to_samples(cols) == samples
    part = samples_to_columns(samples, ["reward", "index"])
    assert list(part) == ["index", "reward"]  # declaration order
    back = columns_to_samples(part)
    assert [s.index for s in back] == [s.index for s in samples] and back[0].response_tokens == []
    with pytest.raises(ValueError):
        Sample.from_dict({"bogus": 1})
    with pytest.raises(ValueError):
        check_fields(["index", "nope"])
    with pytest.raises(ValueError):
        columns_to_samples({"index": [1, 2], "reward": [0.0]})


def test_codec_round_trip_exact():
    samples = make_samples()
    td = encode_samples(samples)
    assert td["response_tokens"].is_nested and td["response_tokens"].dtype == torch.int32
    assert td["response_logprobs"].dtype == torch.float32 and td["loss_mask"].dtype == torch.int8
    back = decode_samples(td)
    assert back == samples
    # bit-exact float32 log-probs and float64 rewards
    for a, b in zip(back, samples):
        assert [struct.pack("f", x) for x in a.response_logprobs] == [struct.pack("f", x) for x in b.response_logprobs]
        assert struct.pack("d", a.reward) == struct.pack("d", b.reward)
    # tuples / int keys survive (msgpack alone would turn tuples into lists)
    assert back[1].metadata["turns"] == (1, 2) and 7 in back[1].metadata
    assert back[1].label == {"answer": (1, "x")}


def test_codec_subset_and_edge_cases():
    samples = make_samples(3)
    cols = decode_columns(encode_samples(samples, fields=["index", "response_tokens"]))
    assert list(cols) == ["index", "response_tokens"]
    assert cols["response_tokens"] == [s.response_tokens for s in samples]
    one = [Sample(index=1, response_text="same")]
    assert decode_samples(encode_samples(one)) == one
    empty = [Sample(index=i, status="aborted") for i in range(3)]  # all token lists empty
    assert decode_samples(encode_samples(empty)) == empty
    with pytest.raises(ValueError):
        encode_samples([])
    for enc in (encode_samples, encode_records):
        with pytest.raises(OverflowError):
            enc([Sample(response_tokens=[2**31])])  # does not fit int32: refuse, never wrap
        with pytest.raises(OverflowError):
            enc([Sample(response_tokens=[1], loss_mask=[200])])
        with pytest.raises(TypeError):
            enc([Sample(response_text=None)])


def test_packed_layout():
    samples = make_samples()
    td = encode_records(samples)
    assert list(td.keys()) == ["record"] and all(isinstance(r, bytes) for r in td["record"])
    assert decode_samples(td) == samples
    cols = decode_columns(td, ["index", "response_logprobs"])
    assert list(cols) == ["index", "response_logprobs"]
    assert cols["response_logprobs"] == [s.response_logprobs for s in samples]
    one = [Sample(index=3)]
    assert decode_samples(encode_records(one)) == one


def test_logprob_precision(caplog):
    d = [0.1, -1e-30, float("nan"), float("-inf")]  # 0.1 is not a float32 value
    s = [Sample(response_tokens=[1, 2, 3, 4], response_logprobs=d)]
    for enc in (encode_samples, encode_records):
        exact = decode_samples(enc(s, logprob_dtype=torch.float64))[0].response_logprobs
        assert exact[:2] == d[:2] and math.isnan(exact[2]) and exact[3] == float("-inf")
        codec._warned_lossy_logprobs = False
        caplog.clear()
        with caplog.at_level("WARNING"):
            rounded = decode_samples(enc(s))[0].response_logprobs
        assert "not exactly representable" in caplog.text
        assert rounded[0] == f32(0.1) and rounded[0] != 0.1


token_lists = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=20)
sample_st = st.builds(
    Sample,
    index=st.integers(min_value=-(2**62), max_value=2**62),
    group_index=st.integers(min_value=0, max_value=1000),
    prompt=st.one_of(st.text(), st.lists(st.dictionaries(st.text(max_size=5), st.text(max_size=5)), max_size=3)),
    prompt_tokens=token_lists,
    response_tokens=token_lists,
    response_logprobs=st.lists(st.floats(width=32, allow_nan=False), max_size=20),
    loss_mask=st.lists(st.integers(min_value=0, max_value=1), max_size=20),
    response_text=st.text(),
    reward=st.floats(allow_nan=False),
    raw_reward=st.one_of(st.none(), st.floats(allow_nan=False), st.dictionaries(st.text(max_size=4), st.floats(allow_nan=False))),
    status=st.sampled_from(["completed", "truncated", "aborted", "failed"]),
    metadata=st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(), st.tuples(st.integers()))),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(sample_st, min_size=1, max_size=6))
def test_codec_property(samples):
    assert decode_samples(encode_samples(samples)) == samples
    assert decode_samples(encode_records(samples)) == samples
