"""Reading JSONL / Parquet prompt files into PromptRecords; bad-row policy."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax.rollout.data_source import (
    PromptDataError,
    PromptDataSource,
    PromptRecord,
    count_prompt_records,
    read_prompt_records,
)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)


ROWS = [
    {"question": "1+1?", "answer": "2", "meta": {"rm_type": "math", "src": "a"}, "tools": [{"name": "calc"}]},
    {"question": [{"role": "user", "content": "hi"}], "answer": "hello", "meta": "{\"src\": \"b\"}"},
    {"question": "no label"},
]


def test_jsonl_records_with_keys(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    recs, counts = read_prompt_records(path, input_key="question", label_key="answer", metadata_key="meta")
    assert counts == {"bad_lines": 0, "filtered_long_prompts": 0}
    assert recs[0] == PromptRecord(0, "1+1?", "2", {"rm_type": "math", "src": "a"}, [{"name": "calc"}])
    assert recs[1] == PromptRecord(1, [{"role": "user", "content": "hi"}], "hello", {"src": "b"}, None)
    assert recs[2] == PromptRecord(2, "no label", None, {}, None)
    with pytest.raises(Exception):
        recs[0].index = 5  # frozen


def test_nested_key_and_record_roundtrip(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"extra": {"q": "deep"}, "label": 3}])
    recs, _ = read_prompt_records(path, input_key="extra.q")
    assert recs[0].prompt == "deep" and recs[0].label == 3
    assert PromptRecord.from_dict(recs[0].to_dict()) == recs[0]


def test_parquet_equals_jsonl(tmp_path):
    rows = [
        {"question": "q0", "answer": "a0", "meta": {"src": "x"}},
        {"question": "q1", "answer": "a1", "meta": {"src": "y"}},
    ] * 3
    jpath = write_jsonl(tmp_path / "p.jsonl", rows)
    ppath = str(tmp_path / "p.parquet")
    pq.write_table(pa.Table.from_pylist(rows), ppath, row_group_size=2)
    kw = dict(input_key="question", label_key="answer", metadata_key="meta")
    assert read_prompt_records(ppath, **kw)[0] == read_prompt_records(jpath, **kw)[0]


def test_parquet_messages_and_missing_prompt(tmp_path):
    ppath = str(tmp_path / "m.parquet")
    rows = [
        {"prompt": [{"role": "user", "content": "a"}], "label": "x"},
        {"prompt": None, "label": "y"},
        {"prompt": [{"role": "user", "content": "b"}], "label": "z"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), ppath)
    with pytest.raises(PromptDataError, match=r"m\.parquet: row 2: missing input key 'prompt'"):
        read_prompt_records(ppath)
    recs, counts = read_prompt_records(ppath, skip_bad_lines=True)
    assert [r.label for r in recs] == ["x", "z"] and [r.index for r in recs] == [0, 1]
    assert recs[1].prompt == [{"role": "user", "content": "b"}]
    assert counts["bad_lines"] == 1


BAD = [
    {"prompt": "ok 1"},
    "{not json",
    "",
    {"text": "no prompt key"},
    "[1, 2]",
    {"prompt": 42},
    {"prompt": "ok 2"},
]


@pytest.mark.parametrize(
    "bad_row,message",
    [
        ("{not json", "malformed JSON"),
        ({"text": "no prompt key"}, "missing input key 'prompt'"),
        ("[1, 2]", "row is not a JSON object"),
        ({"prompt": 42}, "input key 'prompt' must be a string or a list of messages"),
        ({"prompt": ["not a message"]}, "input key 'prompt': a list prompt must hold message objects"),
    ],
)
def test_bad_line_error_names_file_and_line(tmp_path, bad_row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, "", {"prompt": "ok"}, bad_row, {"prompt": "ok"}])
    with pytest.raises(PromptDataError, match=rf"bad\.jsonl:4: {message}"):
        read_prompt_records(path)


def test_first_bad_line_reported_and_skip_counts(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD)
    with pytest.raises(PromptDataError, match=r"bad\.jsonl:2: malformed JSON"):
        PromptDataSource(path)
    src = PromptDataSource(path, skip_bad_lines=True)
    assert src.stats()["bad_lines"] == 4  # blank line 3 is not bad
    assert src.num_prompts == 2
    assert [(r.index, r.prompt) for r in src.get_batch(2)] == [(0, "ok 1"), (1, "ok 2")]
    assert count_prompt_records(path, skip_bad_lines=True) == 2


def test_bad_metadata_and_tools(tmp_path):
    path = write_jsonl(tmp_path / "md.jsonl", [{"prompt": "p", "metadata": "{oops"}])
    with pytest.raises(PromptDataError, match=r"md\.jsonl:1: metadata key 'metadata' is a string that is not valid JSON"):
        read_prompt_records(path)
    path = write_jsonl(tmp_path / "tl.jsonl", [{"prompt": "p", "tools": {"a": 1}}])
    with pytest.raises(PromptDataError, match=r"tl\.jsonl:1: tool key 'tools' must be a list"):
        read_prompt_records(path)


def test_invalid_utf8_is_a_bad_line(tmp_path):
    p = tmp_path / "u.jsonl"
    p.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n')
    with pytest.raises(PromptDataError, match=r"u\.jsonl:2: invalid UTF-8"):
        read_prompt_records(str(p))


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        PromptDataSource(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(PromptDataError, match="unsupported"):
        PromptDataSource(str(tmp_path / "x.csv"))


def test_empty_file_errors_on_get_batch(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", ["", ""])
    for streaming in (False, True):
        src = PromptDataSource(path, streaming=streaming)
        with pytest.raises(PromptDataError, match="no usable prompts"):
            src.get_batch(1)
