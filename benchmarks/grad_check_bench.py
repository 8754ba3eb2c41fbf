"""The trainer's finite-gradient check before each optimizer step, on a grad buffer of SmolLM2-135M's size.

    .venv/bin/python benchmarks/grad_check_bench.py                # 135M float32 elements, 1 thread
    .venv/bin/python benchmarks/grad_check_bench.py --elements 30000000 --threads 2

Times, side by side in rounds (best of each round, then the median), `torch.isfinite(t).all()` (a bool tensor of
t's size, then a reduction) against `relax.backends.megatron.optim.tensor_finite` (one min/max pass), and checks
that both answer alike on a buffer with a NaN, an infinity and none.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", type=int, default=134_515_008)  # SmolLM2-135M's parameters
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    import torch

    from relax.backends.megatron.optim import tensor_finite

    torch.set_num_threads(args.threads)
    grads = torch.randn(args.elements, generator=torch.Generator().manual_seed(0))
    ways = {"isfinite().all()": lambda t: bool(torch.isfinite(t).all()), "tensor_finite": tensor_finite}
    for bad in (None, float("nan"), float("inf")):
        t = grads.clone()
        if bad is not None:
            t[args.elements // 3] = bad
        answers = {name: way(t) for name, way in ways.items()}
        if len(set(answers.values())) != 1:
            print(f"the two checks disagree on a buffer with {bad}: {answers}", file=sys.stderr)
            return 1
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                way(grads)
                best = min(best, time.perf_counter() - t0)
            times[name].append(best)
    for name, ts in times.items():
        print(f"{name:18s} {statistics.median(ts):.4f} s")
    ratio = statistics.median(times["isfinite().all()"]) / statistics.median(times["tensor_finite"])
    print(f"isfinite().all() / tensor_finite: {ratio:.1f}x ({args.elements} elements, {args.threads} thread(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
