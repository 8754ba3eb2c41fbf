"""DataPlane on a real local Ray cluster and a real TransferQueue (2 storage units)."""

import asyncio
import os
import random
import struct
import threading
import time

os.environ.setdefault("TQ_NUM_THREADS", "1")

import pytest  # noqa: E402
import ray  # noqa: E402

from conftest import shared_ray

from relax.data.plane import DataPlane  # noqa: E402
from relax.data.sample import Sample  # noqa: E402

CAPACITY = 200  # 2 units x 100 samples


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def make_samples(n, step=0, start=0, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(start, start + n):
        r = rng.randint(0, 40)
        out.append(
            Sample(
                index=i,
                group_index=i // 4,
                prompt=[{"role": "user", "content": f"Frage {i}: ünïcødé 中文 🚀"}],
                prompt_tokens=[rng.randint(0, 151_000) for _ in range(rng.randint(1, 30))],
                response_tokens=[rng.randint(0, 151_000) for _ in range(r)],
                response_logprobs=[f32(-rng.random() * 10) for _ in range(r)],
                loss_mask=[rng.randint(0, 1) for _ in range(r)],
                response_text="ответ " * (i % 3) + "✓",
                label=("42", i),
                reward=rng.random() - 0.5,
                raw_reward={"acc": rng.random(), "format": (True, None)},
                status="truncated" if r == 40 else "completed",
                weight_version=step,
                metadata={"step": step, "turns": (1, 2), 3: "int key"},
                rollout_step=step,
            )
        )
    return out


@pytest.fixture(scope="module")
def owner():
    shared_ray()
    dp = DataPlane.start(num_storage_units=2, capacity_samples=CAPACITY)  # layout "columns"
    try:
        yield dp
    finally:
        dp.shutdown()


@pytest.fixture(scope="module", params=["columns", "packed"])
def plane(request, owner):
    # One TransferQueue for both layouts (saves a restart): the packed plane is a second
    # handle on the same controller with its own partition prefix.
    if request.param == "columns":
        yield owner
    else:
        dp = DataPlane.attach(partition_prefix="packed", layout="packed", timeout_s=5)
        yield dp
        dp.shutdown()


@pytest.fixture
def dp(plane):
    yield plane
    for step in plane.steps():
        plane.clear(step)


def test_round_trip_exact(dp):
    assert dp.layout in ("columns", "packed")
    samples = make_samples(24, step=1)
    shuffled = samples[:]
    random.Random(1).shuffle(shuffled)
    assert dp.put(1, shuffled) == 24
    back = dp.get(1)
    assert [s.index for s in back] == list(range(24))  # index order
    assert back == samples
    for a, b in zip(back, samples):  # bit-exact float32 log-probs
        assert struct.pack(f"{len(a.response_logprobs)}f", *a.response_logprobs) == struct.pack(
            f"{len(b.response_logprobs)}f", *b.response_logprobs
        )
    assert back[3].metadata["turns"] == (1, 2) and back[3].metadata[3] == "int key"
    # a non-consuming read can be repeated
    assert dp.get(1) == samples


def test_fields_subset_and_append(dp):
    a, b = make_samples(5, start=0), make_samples(5, start=5, seed=3)
    dp.put(2, b)
    dp.put(2, a)  # second put appends to the same partition
    assert dp.size(2) == 10
    part = dp.get(2, fields=["response_tokens", "reward"])
    assert [s.index for s in part] == list(range(10))
    assert [s.response_tokens for s in part] == [s.response_tokens for s in a + b]
    assert [s.reward for s in part] == [s.reward for s in a + b]
    assert all(s.prompt_tokens == [] and s.metadata == {} for s in part)  # not read: defaults


def test_steps_do_not_mix_and_clear_frees(dp):
    s3, s4 = make_samples(6, step=3), make_samples(9, step=4, start=100, seed=4)
    dp.put(3, s3)
    dp.put(4, s4)
    assert dp.steps() == [3, 4]
    assert dp.get(3) == s3 and dp.get(4) == s4
    assert dp.stats() == {"num_partitions": 2, "num_samples": 15, "samples_per_step": {3: 6, 4: 9}}
    dp.clear(3)
    assert dp.steps() == [4] and dp.get(3) == [] and dp.size(3) == 0
    assert dp.get(4) == s4
    dp.clear(3)  # absent: no-op
    dp.clear(4)
    assert dp.stats() == {"num_partitions": 0, "num_samples": 0, "samples_per_step": {}}
    # freed capacity is reusable: fill to the limit twice
    for _ in range(2):
        dp.put(5, make_samples(CAPACITY // 2, step=5))
        dp.put(6, make_samples(CAPACITY // 2, step=6))
        dp.clear(5)
        dp.clear(6)


def test_consuming_batches(dp):
    samples = make_samples(10, step=7)
    dp.put(7, samples)
    first = dp.get(7, batch_size=4)
    second = dp.get(7, batch_size=4)
    assert len(first) == 4 and len(second) == 4
    assert {s.index for s in first}.isdisjoint({s.index for s in second})
    assert dp.get(7, batch_size=4) == []  # only 2 left: polling mode returns nothing
    assert len(dp.get(7, batch_size=2)) == 2
    assert len(dp.get(7, batch_size=10, task_name="other")) == 10  # consumption is per task
    assert dp.get(7) == samples  # the non-consuming read still sees all


def test_consuming_order_survives_index_recycling(dp):
    # earlier tests cleared partitions, so TQ hands out recycled global indexes in set order
    dp.put(30, make_samples(40, step=30, seed=5))
    dp.clear(30)
    samples = make_samples(12, step=31)
    dp.put(31, samples[6:])
    dp.put(31, samples[:6])
    got = [dp.get(31, batch_size=4) for _ in range(3)]
    assert got == [samples[0:4], samples[4:8], samples[8:12]]


def test_whole_groups(dp):
    samples = make_samples(16, step=32)  # groups of 4: group_index = index // 4
    by_group = [samples[i : i + 4] for i in range(0, 16, 4)]
    dp.put(32, by_group[2])
    dp.put(32, by_group[0][:3])  # group 0 incomplete
    dp.put(32, by_group[1])
    assert dp.get(32, batch_size=8, group_size=4) == by_group[1] + by_group[2]
    assert dp.get(32, batch_size=4, group_size=4) == []  # group 0 still incomplete
    dp.put(32, by_group[0][3:] + by_group[3])
    assert dp.get(32, batch_size=4, group_size=4) == by_group[0]
    assert dp.get(32, batch_size=4, group_size=4) == by_group[3]
    with pytest.raises(ValueError):
        dp.get(32, batch_size=6, group_size=4)


def test_get_waits_for_late_producer(dp):
    samples = make_samples(6, step=8)
    timer = threading.Timer(0.3, dp.put, args=(8, samples))
    timer.start()
    t0 = time.monotonic()
    got = dp.get(8, batch_size=6, timeout_s=20)
    timer.join()
    assert got == samples and time.monotonic() - t0 >= 0.25
    assert dp.get(9, batch_size=1, timeout_s=0.1) == []


def test_async_api(dp):
    samples = make_samples(4, step=10)

    async def main():
        await dp.aput(10, samples)
        return await dp.aget(10), await dp.aget(10, batch_size=4, timeout_s=5)

    everything, batch = asyncio.run(main())
    assert everything == samples and batch == samples


def test_failed_put_rolls_back(dp):
    dp.put(11, make_samples(10, step=11))
    with pytest.raises(RuntimeError, match="capacity"):
        dp.put(12, make_samples(CAPACITY, step=12))  # exceeds the units' capacity
    assert dp.size(12) == 0 and dp.size(11) == 10
    dp.clear(12)
    assert dp.steps() == [11]
    dp.put(12, make_samples(CAPACITY - 10, step=12))  # the failed put left no residue
    assert dp.size(12) == CAPACITY - 10


def test_start_twice_refused_and_second_handle(dp, owner):
    assert owner.config.backend.SimpleStorage.num_data_storage_units == 2
    with pytest.raises(RuntimeError, match="already"):
        DataPlane.start(num_storage_units=2)
    other = DataPlane.attach(partition_prefix=dp.partition_prefix, layout=dp.layout, timeout_s=5)
    samples = make_samples(3, step=13)
    other.put(13, samples)
    other.shutdown()  # not the last handle in this process: the client stays open
    assert dp.get(13) == samples


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, prefix, layout=None):
        os.environ["TQ_NUM_THREADS"] = "1"
        self.dp = DataPlane.attach(partition_prefix=prefix, layout=layout, timeout_s=30)

    def read(self, step, batch_size=None):
        return self.dp.get(step, batch_size=batch_size)

    def write(self, step, samples):
        return self.dp.put(step, samples)

    def stats(self):
        return self.dp.stats()

    def layout(self):
        return self.dp.layout

    def close(self):
        self.dp.shutdown()
        return True


def test_consumer_in_other_actor(dp):
    samples = make_samples(16, step=20)
    dp.put(20, samples)
    layout = None if dp.is_owner else dp.layout  # None: attach picks up the owner's layout
    w = Worker.remote(dp.partition_prefix, layout)
    try:
        assert ray.get(w.layout.remote()) == dp.layout
        assert ray.get(w.read.remote(20)) == samples
        assert ray.get(w.read.remote(20, 8)) == samples[:8]
        produced = make_samples(5, step=21, start=500, seed=9)
        assert ray.get(w.write.remote(21, produced)) == 5  # and the other direction
        assert dp.get(21) == produced
        assert ray.get(w.stats.remote())["samples_per_step"] == {20: 16, 21: 5}
        assert ray.get(w.close.remote())
    finally:
        ray.kill(w)
    # the worker's shutdown did not take the shared controller down
    assert dp.get(20) == samples
