"""PromptDataSource: epochs, shuffle, add_back buffer, state_dict resume, streaming mode."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax.rollout.data_source import PromptDataSource, PromptRecord


def make_jsonl(path, n, bad_every=0):
    with open(path, "w") as f:
        for i in range(n):
            if bad_every and i % bad_every == bad_every - 1:
                f.write("{broken\n")
            f.write(json.dumps({"prompt": f"p{i}", "label": str(i), "metadata": {"i": i}}) + "\n")
    return str(path)


def ids(batch):
    return [r.index if isinstance(r, PromptRecord) else r for r in batch]


def drain(src, sizes):
    return [ids(src.get_batch(k)) for k in sizes]


@pytest.fixture
def jsonl(tmp_path):
    return make_jsonl(tmp_path / "p.jsonl", 10)


def test_epoch_rollover_in_order(jsonl):
    src = PromptDataSource(jsonl)
    assert src.num_prompts == 10 and len(src) == 10
    assert drain(src, [4, 4, 4]) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert src.epoch == 1


def test_shuffle_is_seeded_per_epoch(jsonl):
    a = PromptDataSource(jsonl, shuffle=True, rollout_seed=1)
    b = PromptDataSource(jsonl, shuffle=True, rollout_seed=1)
    c = PromptDataSource(jsonl, shuffle=True, rollout_seed=2)
    ea, eb, ec = drain(a, [10, 10]), drain(b, [10, 10]), drain(c, [10, 10])
    assert ea == eb
    assert ea != ec
    assert sorted(ea[0]) == list(range(10)) and sorted(ea[1]) == list(range(10))
    assert ea[0] != ea[1]  # a new permutation each epoch
    assert ea[0] != list(range(10))


def test_add_back_served_first(jsonl):
    src = PromptDataSource(jsonl)
    first = src.get_batch(3)
    src.add_back([["g0-s0", "g0-s1"], first[1]])
    batch = src.get_batch(3)
    assert batch[0] == ["g0-s0", "g0-s1"] and batch[1] is first[1] and batch[2].index == 3
    assert src.stats()["buffered_groups"] == 0


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_state_dict_resume_is_exact(jsonl, streaming, shuffle):
    kw = dict(shuffle=shuffle, rollout_seed=3, streaming=streaming, buffer_size=4)
    ref = PromptDataSource(jsonl, **kw)
    expected = drain(ref, [3, 5, 7, 9, 4])

    expected = [i for b in expected for i in b]  # 28 items, ~3 epochs
    src = PromptDataSource(jsonl, **kw)
    got = [i for b in drain(src, [3, 5]) for i in b]
    src.add_back([src.get_batch(1)[0]])  # a returned record sits in the buffer
    state = json.loads(json.dumps(src.state_dict()))  # JSON-serializable
    resumed = PromptDataSource(jsonl, **kw)
    resumed.load_state_dict(state)
    nxt = ids(resumed.get_batch(1))
    assert nxt == [expected[8]]  # the buffered record comes back first
    got += nxt + ids(resumed.get_batch(19))
    assert got == expected
    assert resumed.epoch == ref.epoch


def test_state_mismatch_is_refused(jsonl, tmp_path):
    src = PromptDataSource(jsonl, shuffle=True, rollout_seed=1)
    state = src.state_dict()
    with pytest.raises(ValueError, match="rollout_seed"):
        PromptDataSource(jsonl, shuffle=True, rollout_seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="streaming"):
        PromptDataSource(jsonl, shuffle=True, rollout_seed=1, streaming=True).load_state_dict(state)
    other = make_jsonl(tmp_path / "other.jsonl", 11)
    with pytest.raises(ValueError, match="saved with 10 prompts"):
        PromptDataSource(other, shuffle=True, rollout_seed=1).load_state_dict(state)


@pytest.mark.parametrize("buffer_size", [1, 3, 10, 64])
def test_streaming_equals_eager_without_shuffle(tmp_path, buffer_size):
    path = make_jsonl(tmp_path / "p.jsonl", 23, bad_every=5)
    eager = PromptDataSource(path, skip_bad_lines=True)
    stream = PromptDataSource(path, skip_bad_lines=True, streaming=True, buffer_size=buffer_size)
    sizes = [7, 1, 30, 12]
    e = [eager.get_batch(k) for k in sizes]
    s = [stream.get_batch(k) for k in sizes]
    assert e == s  # same records (index, prompt, label, metadata) in the same order
    assert stream.epoch == eager.epoch == 2
    assert stream.stats()["bad_lines"] == eager.stats()["bad_lines"] == 4
    assert stream.num_prompts == 23


def test_streaming_shuffle_within_blocks(tmp_path):
    path = make_jsonl(tmp_path / "p.jsonl", 20)
    kw = dict(streaming=True, shuffle=True, buffer_size=5, rollout_seed=9)
    a = drain(PromptDataSource(path, **kw), [20, 20])
    assert a == drain(PromptDataSource(path, **kw), [20, 20])
    for epoch in a:
        assert sorted(epoch) == list(range(20))
        for blk in range(4):  # each block of 5 is a permutation of its own rows
            assert sorted(epoch[blk * 5 : blk * 5 + 5]) == list(range(blk * 5, blk * 5 + 5))
    assert a[0] != list(range(20)) and a[0] != a[1]


def test_streaming_parquet_matches_jsonl_and_resumes(tmp_path):
    rows = [{"prompt": f"p{i}", "label": str(i), "metadata": {"i": i}} for i in range(17)]
    ppath = str(tmp_path / "p.parquet")
    pq.write_table(pa.Table.from_pylist(rows), ppath, row_group_size=4)
    jpath = make_jsonl(tmp_path / "p.jsonl", 17)
    kw = dict(streaming=True, buffer_size=3)
    assert PromptDataSource(ppath, **kw).get_batch(40) == PromptDataSource(jpath, **kw).get_batch(40)
    src = PromptDataSource(ppath, **kw)
    src.get_batch(11)
    state = src.state_dict()
    assert state["offset"] == 9  # block start, as a row number for Parquet
    resumed = PromptDataSource(ppath, **kw)
    resumed.load_state_dict(state)
    assert ids(resumed.get_batch(10)) == ids(PromptDataSource(ppath).get_batch(21))[11:]


def test_streaming_state_uses_byte_offset(tmp_path):
    path = make_jsonl(tmp_path / "p.jsonl", 10)
    src = PromptDataSource(path, streaming=True, buffer_size=4)
    src.get_batch(5)  # block 1 (records 4..7) is current
    state = src.state_dict()
    with open(path, "rb") as f:
        lines = f.readlines()
    assert state["offset"] == sum(len(x) for x in lines[:4])
    assert state["position"] == 1 and state["block_no"] == 1


def test_streaming_large_file_flat_memory(tmp_path):
    n = 20000
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            f.write('{"prompt": "p%d"}\n' % i)
    src = PromptDataSource(str(path), streaming=True, shuffle=True, buffer_size=256)
    seen = []
    for _ in range(n // 500):
        seen.extend(ids(src.get_batch(500)))
        assert len(src._block) <= 256  # only one block is held
    assert sorted(seen) == list(range(n))
    assert src.num_prompts == n


def test_streaming_counts_survive_mid_epoch_resume(tmp_path):
    path = make_jsonl(tmp_path / "p.jsonl", 20, bad_every=3)
    eager_bad = PromptDataSource(path, skip_bad_lines=True).stats()["bad_lines"]
    kw = dict(skip_bad_lines=True, streaming=True, buffer_size=4)
    src = PromptDataSource(path, **kw)
    src.get_batch(6)  # mid epoch 0, some bad lines seen
    state = src.state_dict()
    assert 0 < state["counts"]["bad_lines"] < eager_bad
    resumed = PromptDataSource(path, **kw)
    resumed.load_state_dict(state)
    resumed.get_batch(40)  # finish epoch 0 and go on
    assert resumed.stats()["bad_lines"] == eager_bad == 6


def test_served_records_are_private_copies(jsonl):
    src = PromptDataSource(jsonl)
    first = src.get_batch(10)
    first[0].metadata["reward_error"] = "x"
    again = src.get_batch(1)[0]
    assert again.index == 0 and "reward_error" not in again.metadata
