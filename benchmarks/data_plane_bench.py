"""Put+get throughput of the DataPlane (TransferQueue) vs the Ray object store.

    python benchmarks/data_plane_bench.py [--batch-sizes 64 256 1024 4096] [--reps 3]
                                          [--layouts columns packed]

For each batch size the same ``list[Sample]`` (prompt 256 tokens, responses 256-768 tokens,
float32 log-probs, loss mask, short text and metadata) goes through:

  dp local     DataPlane.put + DataPlane.get in the driver (includes Sample encode/decode)
  dp->actor    DataPlane.put in the driver, DataPlane.get in another Ray actor
  ray local    ray.put + ray.get in the driver
  ray->actor   ray.put in the driver, ray.get in another Ray actor

MB is the payload (token/log-prob/mask bytes + UTF-8 text + pickled objects). The actor
variants return only a count, so the time is producer put + consumer get + one actor call.
Best of ``--reps`` runs. One table per DataPlane layout (see ``relax.data.codec``); the ray
columns are measured once per batch size and repeated.
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("TQ_NUM_THREADS", "1")

import ray  # noqa: E402
import torch  # noqa: E402

from relax.data.codec import decode_samples, encode_records, encode_samples  # noqa: E402
from relax.data.plane import DataPlane  # noqa: E402
from relax.data.sample import Sample  # noqa: E402


def make_batch(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        r = rng.randint(256, 768)
        out.append(
            Sample(
                index=i,
                group_index=i // 8,
                prompt="Solve: " + "x" * 200,
                prompt_tokens=torch.randint(0, 150_000, (256,), generator=g).tolist(),
                response_tokens=torch.randint(0, 150_000, (r,), generator=g).tolist(),
                response_logprobs=(-torch.rand(r, generator=g) * 5).tolist(),
                loss_mask=[1] * r,
                response_text="y" * r,
                label="42",
                reward=rng.random(),
                raw_reward={"acc": 1.0},
                metadata={"turns": 1, "source": "bench"},
            )
        )
    return out


def payload_bytes(samples: list[Sample]) -> int:
    td = encode_samples(samples)
    total = 0
    for key in td.keys():
        col = td[key]
        if isinstance(col, torch.Tensor):
            total += (col.values() if col.is_nested else col).numel() * col.dtype.itemsize
        else:
            total += sum(len(v.encode()) if isinstance(v, str) else len(v) for v in col)
    return total


@ray.remote(num_cpus=0)
class Consumer:
    def __init__(self):
        os.environ["TQ_NUM_THREADS"] = "1"
        self.dp = DataPlane.attach()

    def dp_get(self, step: int) -> int:
        return len(self.dp.get(step))

    def ray_get(self, refs: list) -> int:
        return len(ray.get(refs[0]))

    def close(self):
        self.dp.shutdown()


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--storage-units", type=int, default=2)
    ap.add_argument("--layouts", nargs="+", default=["columns", "packed"], choices=["columns", "packed"])
    args = ap.parse_args()

    ray.init(num_cpus=16, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray_times: dict[int, tuple[float, float]] = {}
    try:
        for layout in args.layouts:
            run_layout(layout, args, ray_times)
    finally:
        ray.shutdown()


def run_layout(layout: str, args, ray_times: dict) -> None:
    dp = DataPlane.start(num_storage_units=args.storage_units, layout=layout)
    consumer = Consumer.remote()
    ray.get(consumer.dp_get.remote(-1))  # warm up the actor's client
    step = 0
    print(f"\nlayout={layout}, {args.storage_units} storage units")
    print(f"{'batch':>6} {'MB':>7} | {'dp local':>9} {'dp->actor':>9} {'ray local':>9} {'ray->actor':>10}"
          f" | {'dp put':>7} {'dp get':>7} {'encode':>7} {'decode':>7}   (MB/s; ms)")
    encode = encode_records if layout == "packed" else encode_samples
    try:
        for n in args.batch_sizes:
            samples = make_batch(n)
            mb = payload_bytes(samples) / 2**20

            def dp_local():
                nonlocal step
                step += 1
                dp.put(step, samples)
                assert len(dp.get(step)) == n
                dp.clear(step)

            def dp_remote():
                nonlocal step
                step += 1
                dp.put(step, samples)
                assert ray.get(consumer.dp_get.remote(step)) == n
                dp.clear(step)

            def ray_local():
                ref = ray.put(samples)
                assert len(ray.get(ref)) == n
                del ref

            def ray_remote():
                ref = ray.put(samples)
                assert ray.get(consumer.ray_get.remote([ref])) == n
                del ref

            t_dl, t_dr = best(dp_local, args.reps), best(dp_remote, args.reps)
            if n not in ray_times:
                ray_times[n] = (best(ray_local, args.reps), best(ray_remote, args.reps))
            t_rl, t_rr = ray_times[n]

            # split of the local DataPlane time
            step += 1
            t0 = time.perf_counter()
            dp.put(step, samples)
            t_put = time.perf_counter() - t0
            t0 = time.perf_counter()
            dp.get(step)
            t_get = time.perf_counter() - t0
            dp.clear(step)
            t_enc = best(lambda: encode(samples), args.reps)
            td = encode(samples)
            t_dec = best(lambda: decode_samples(td), args.reps)
            print(f"{n:>6} {mb:>7.2f} | {mb / t_dl:>9.1f} {mb / t_dr:>9.1f} {mb / t_rl:>9.1f} {mb / t_rr:>10.1f}"
                  f" | {t_put * 1e3:>7.1f} {t_get * 1e3:>7.1f} {t_enc * 1e3:>7.1f} {t_dec * 1e3:>7.1f}", flush=True)
    finally:
        try:
            ray.get(consumer.close.remote())
        except Exception:
            pass
        ray.kill(consumer)
        dp.shutdown()


if __name__ == "__main__":
    main()
