"""Cost of stage fields on the data plane against the packed layout alone.

    python benchmarks/data_plane_fields_bench.py [--samples 512 256] [--response-lens 8 512] [--reps 3]

One step's samples (prompt 24 tokens, the given response length) are put once with their rollout record
(``layout="packed"``, as the controller runs it). Then, as the stages of one synchronous ppo + KL step do:

  put record        DataPlane.put of the rollout record (the rollout stage; the same as before stage fields)
  get record        DataPlane.get of the whole step (what the actor read once per step before)
  put 1 field       one stage writing one field for every sample (reference, critic, teacher, actor forward)
  put 2 fields      the advantage stage writing advantages + returns in one call
  get rec+2 fields  a stage reading the record and two fields (the update: advantages + old log-probs)
  get rec+4 fields  the advantage stage's read (old/ref log-probs, values, teacher log-probs)
  stage total       every field write and read of one ppo + KL + OPD step (5 writes: ref, teacher, values,
                    old, advantages+returns; reads: advantages 4 fields, update 3, critic 2), beyond the
                    record's put and get that the step made before
  rewrite record    the alternative without fields of their own: a stage re-puts the whole record (here:
                    once per writing stage, 5 per step) so that its rows travel inside it

Everything runs in this process (put and get in the driver); best of ``--reps``, milliseconds.
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("TQ_NUM_THREADS", "1")

import ray  # noqa: E402
import torch  # noqa: E402

from relax.data.plane import DataPlane  # noqa: E402
from relax.data.sample import Sample  # noqa: E402


def make_step(n: int, response_len: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    return [Sample(index=i, group_index=i // 16, prompt="What follows 3?", label="4", reward=rng.random(),
                   prompt_tokens=torch.randint(0, 50_000, (24,), generator=g).tolist(),
                   response_tokens=torch.randint(0, 50_000, (response_len,), generator=g).tolist(),
                   response_logprobs=(-torch.rand(response_len, generator=g) * 5).tolist(),
                   loss_mask=[1] * response_len, response_text="y" * response_len, metadata={"turns": 1})
            for i in range(n)]


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def bench(dp: DataPlane, n: int, response_len: int, reps: int) -> dict[str, float]:
    samples = make_step(n, response_len)
    index = [s.index for s in samples]
    rows = [torch.randn(response_len, dtype=torch.float32) for _ in samples]
    step = 0
    out = {}

    def fresh():
        dp.clear(step)
        dp.put(step, samples)

    def timed_put():
        dp.clear(step)
        t0 = time.perf_counter()
        dp.put(step, samples)
        return time.perf_counter() - t0

    out["put record"] = min(timed_put() for _ in range(reps)) * 1e3
    out["get record"] = best(lambda: dp.get(step), reps)
    out["put 1 field"] = best(lambda: dp.put_fields(step, index, ref_logprobs=rows), reps)
    out["put 2 fields"] = best(lambda: dp.put_fields(step, index, advantages=rows, returns=rows), reps)
    for name in ("values", "teacher_logprobs", "old_logprobs"):
        dp.put_fields(step, index, **{name: rows})
    out["get rec+2 fields"] = best(lambda: dp.get(step, fields=("index", "response_tokens", "advantages",
                                                                 "old_logprobs")), reps)
    out["get rec+4 fields"] = best(lambda: dp.get(step, fields=("index", "response_tokens", "old_logprobs",
                                                                 "ref_logprobs", "values", "teacher_logprobs")), reps)

    def stage_total():
        for name in ("ref_logprobs", "teacher_logprobs", "values", "old_logprobs"):
            dp.put_fields(step, index, **{name: rows})
        dp.put_fields(step, index, advantages=rows, returns=rows)
        dp.get(step, fields=("index", "response_tokens", "old_logprobs", "ref_logprobs", "values",
                             "teacher_logprobs"))
        dp.get(step, fields=("index", "response_tokens", "advantages", "old_logprobs", "ref_logprobs"))
        dp.get(step, fields=("index", "response_tokens", "values", "returns"))

    fresh()
    out["stage total"] = best(stage_total, reps)

    def rewrite_record():
        for _ in range(5):
            dp.clear(step)
            dp.put(step, samples)

    out["rewrite record"] = best(rewrite_record, reps)
    dp.clear(step)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", default=[512, 256])
    parser.add_argument("--response-lens", type=int, nargs="+", default=[8, 512])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    dp = DataPlane.start(num_storage_units=1, layout="packed")
    try:
        for n, length in zip(args.samples, args.response_lens):
            res = bench(dp, n, length, args.reps)
            print(f"\n{n} samples, response {length} tokens (ms, best of {args.reps}):")
            for key, value in res.items():
                print(f"  {key:<18} {value:9.1f}")
    finally:
        dp.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
