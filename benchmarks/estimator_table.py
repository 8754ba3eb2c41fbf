"""Reward and speed per advantage estimator on the embedded default task (the table of the algorithm issue).

    .venv/bin/python benchmarks/estimator_table.py --steps 60                    # grpo gspo rloo ppo
    .venv/bin/python benchmarks/estimator_table.py --steps 60 --estimators grpo reinforce_plus_plus

Each estimator runs `relax-train` on the embedded default (same model, data, seeds and preset; only
--advantage-estimator changes) for --steps rollout steps, one after the other, and the table gives the
mean reward of the first 3 and of the last 5 steps, the best 5-step window, the first step whose 5-step mean
exceeds 0.8 (if any), and the median seconds per step. Runs are deterministic (per-sample sampling seeds),
so rewards do not depend on machine load; seconds per step do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

EXTRA = {"ppo": ["--critic-lr", "2e-3"]}  # the critic learns at the actor's preset rate


def run(estimator: str, steps: int, out: Path, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "relax.entrypoints.train", "--output-dir", str(out), "--num-rollout", str(steps),
           "--advantage-estimator", estimator, *EXTRA.get(estimator, []), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{estimator}: run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"step"' in line]


def window_means(rewards: list[float], width: int = 5) -> list[float]:
    return [statistics.fmean(rewards[i - width + 1:i + 1]) for i in range(width - 1, len(rewards))]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--estimators", nargs="+", default=["grpo", "gspo", "rloo", "ppo"])
    p.add_argument("--keep", default=None, help="keep run directories under this folder")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.keep or tmp)
        for est in args.estimators:
            records = [r for r in run(est, args.steps, base / est, args.extra) if "rollout/reward_mean" in r]
            rewards = [r["rollout/reward_mean"] for r in records]
            windows = window_means(rewards)
            above = next((i + 4 for i, w in enumerate(windows) if w > 0.8), None)
            rows.append((est, statistics.fmean(rewards[:3]), statistics.fmean(rewards[-5:]), max(windows),
                         above, statistics.median(r["perf/step_time"] for r in records[1:])))
            print(f"done {est}", file=sys.stderr, flush=True)
    print(f"embedded default task, {args.steps} rollout steps per estimator (512 samples/step)")
    print("| estimator | reward steps 0-2 | reward last 5 steps | best 5-step mean | first step 5-step mean > 0.8 "
          "| s/step (median) |")
    print("|---|---|---|---|---|---|")
    for est, first, last, best, above, sec in rows:
        print(f"| {est} | {first:.3f} | {last:.3f} | {best:.3f} | {above if above is not None else '-'} | {sec:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
