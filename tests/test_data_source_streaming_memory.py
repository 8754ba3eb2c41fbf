"""--use-streaming-dataset keeps memory flat: what the streaming PromptDataSource holds while a file is read
through does not grow with the file (it holds one block of --streaming-buffer-size records), while eager
mode holds every record. Measured with tracemalloc (Python heap, deterministic) rather than RSS.
benchmarks/streaming_memory_bench.py measures the same on RSS with a 2,000,000-prompt file."""

import json
import tracemalloc

import pytest

from relax.rollout.data_source import PromptDataSource

BUFFER = 500
BATCH = 64


def write(path, n):
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": f"Question {i}: what is {i % 97} + {i % 61}?",
                                 "label": str(i % 97 + i % 61), "metadata": {"id": i}}) + "\n" for i in range(n))
    return str(path)


def held_while_reading(path, n, streaming, shuffle=False):
    """(peak traced bytes while serving n prompts, traced bytes held after building the source)."""
    seen = bytearray(n)  # allocated before tracing starts
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        source = PromptDataSource(path, streaming=streaming, buffer_size=BUFFER, shuffle=shuffle, rollout_seed=3)
        built = tracemalloc.get_traced_memory()[0] - base
        peak, served = 0, 0
        while served < n:
            batch = source.get_batch(min(BATCH, n - served))
            served += len(batch)
            for r in batch:
                seen[r.index] += 1
            del batch, r
            peak = max(peak, tracemalloc.get_traced_memory()[0] - base)
        assert seen == b"\x01" * n and source.epoch == 0  # one full pass, every record once
        return peak, built
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream_mem")
    return {n: write(d / f"p{n}.jsonl", n) for n in (2_000, 20_000)}


@pytest.fixture(scope="module")
def eager_big(files):
    return held_while_reading(files[20_000], 20_000, streaming=False)[1]


@pytest.mark.parametrize("shuffle", [False, True])
def test_streaming_memory_does_not_grow_with_the_file(files, eager_big, shuffle):
    small, _ = held_while_reading(files[2_000], 2_000, streaming=True, shuffle=shuffle)
    big, built = held_while_reading(files[20_000], 20_000, streaming=True, shuffle=shuffle)
    assert built < 64 * 1024  # nothing is read up front
    # a 10x longer file: the streaming source holds about the same (one block), not 10x
    assert big < 1.5 * small + 256 * 1024, (small, big)
    # the measure sees retention: eager mode holds every record, several times one streaming block
    assert eager_big > 5 * big, (eager_big, big)
