"""Seed sweep of the embedded default: does `relax-train` learn for every seed, and how fast?

    .venv/bin/python benchmarks/seed_sweep.py --out runs/sweep                       # 8 seeds x 100 steps
    .venv/bin/python benchmarks/seed_sweep.py --out runs/sweep --seeds 1234,4321 --parallel 1
    .venv/bin/python benchmarks/seed_sweep.py --out runs/sweep --summarise           # only read finished runs
    .venv/bin/python benchmarks/seed_sweep.py --out runs/sweep -- --lr 1e-3          # extra relax-train flags

Runs `relax-train --output-dir OUT/seed_<S> --seed S --num-rollout STEPS` for each seed, --parallel at a time
(each run's console in OUT/seed_<S>/console.log), then reads each run's metrics.jsonl and prints per seed the
first step whose 5-step mean of `rollout/reward_mean` exceeds --threshold (the mean of steps i-4..i), the
final reward (last step, and the mean of the last 5), the largest `train/approx_kl`, the steps the collapse
monitor would flag, and launch-to-first-step seconds; then min / median / max of the crossing step (a seed
that never crosses counts as STEPS, and is named). A run folder that already holds STEPS steps is not rerun.
Exit status 1 when some seed does not cross.

With --parallel 2 the runs share the CPUs, so per-step times and start-up are slower than alone; the learning
metrics do not depend on load (the runs are deterministic per machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_SEEDS = (1234, 4321, 777, 5555, 1, 2, 3, 42)
WINDOW = 5


def read_metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def crossing_step(rewards: list[float], threshold: float, window: int = WINDOW) -> int | None:
    """First step i (>= window - 1) with mean(rewards[i-window+1..i]) > threshold, else None."""
    for i in range(window - 1, len(rewards)):
        if statistics.fmean(rewards[i - window + 1:i + 1]) > threshold:
            return i
    return None


def flagged_steps(records: list[dict]) -> list[int]:
    from relax.observability.metrics import CollapseMonitor

    class _Quiet:
        def warning(self, *a):
            pass

        info = warning

    mon = CollapseMonitor(repeat_every=10**9, log=_Quiet())
    return [r["step"] for r in records if mon.check(r["step"], r)]


def _save_startup(out: Path, startup: dict[int, float | None]) -> None:
    path = out / "startup.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    old.update({str(k): v for k, v in startup.items() if v is not None})
    path.write_text(json.dumps(old))


def run_all(seeds: list[int], steps: int, parallel: int, out: Path, extra: list[str]) -> dict[int, float | None]:
    """Launch the runs; returns launch-to-first-step seconds per seed (None: already done or no step)."""
    todo = [s for s in seeds if len(read_metrics(out / f"seed_{s}")) < steps]
    startup: dict[int, float | None] = {s: None for s in seeds}
    running: dict[int, tuple[subprocess.Popen, float, object]] = {}
    while todo or running:
        while todo and len(running) < parallel:
            seed = todo.pop(0)
            folder = out / f"seed_{seed}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "metrics.jsonl").unlink(missing_ok=True)  # a partial run starts over
            cmd = [sys.executable, "-m", "relax.entrypoints.train", "--output-dir", str(folder), "--seed", str(seed),
                   "--num-rollout", str(steps), *extra]
            log = (folder / "console.log").open("w")
            print(f"[sweep] seed {seed}: {' '.join(cmd[1:])}", flush=True)
            running[seed] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), time.monotonic(), log)
        time.sleep(1.0)
        for seed, (proc, t0, log) in list(running.items()):
            if startup[seed] is None and (out / f"seed_{seed}" / "metrics.jsonl").is_file() and \
                    (out / f"seed_{seed}" / "metrics.jsonl").stat().st_size > 0:
                startup[seed] = time.monotonic() - t0
                _save_startup(out, startup)  # kept even if the sweep is stopped before the end
            if proc.poll() is not None:
                log.close()
                del running[seed]
                n = len(read_metrics(out / f"seed_{seed}"))
                print(f"[sweep] seed {seed}: exit {proc.returncode}, {n} steps, "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
    return startup


def summarise(seeds: list[int], steps: int, threshold: float, out: Path,
              startup: dict[int, float | None]) -> int:
    rows, crossings, missing = [], [], []
    print(f"\n| seed | 5-step mean > {threshold} at step | final reward (last / mean of last {WINDOW}) | "
          "max approx_kl | collapse-monitor steps | launch to first step (s) |")
    print("|---|---|---|---|---|---|")
    for seed in seeds:
        recs = read_metrics(out / f"seed_{seed}")
        if not recs:
            print(f"| {seed} | no metrics | | | | |")
            missing.append(seed)
            continue
        rewards = [r["rollout/reward_mean"] for r in recs]
        cross = crossing_step(rewards, threshold)
        crossings.append(cross if cross is not None else steps)
        if cross is None:
            missing.append(seed)
        kl = max((r.get("train/approx_kl", 0.0) for r in recs), default=0.0)
        flags = flagged_steps(recs)
        flag_txt = (f"{len(flags)} (first {flags[0]})" if flags else "0")
        up = startup.get(seed)
        rows.append(seed)
        print(f"| {seed} | {cross if cross is not None else f'never ({len(recs)} steps)'} | {rewards[-1]:.3f} / "
              f"{statistics.fmean(rewards[-WINDOW:]):.3f} | {kl:.3f} | {flag_txt} | "
              f"{f'{up:.1f}' if up is not None else '-'} |")
    if crossings:
        print(f"\ncrossing step over {len(crossings)} seeds: min {min(crossings)}, median "
              f"{statistics.median(crossings):g}, max {max(crossings)}"
              + (f"; not crossing: {missing}" if missing else "; every seed crossed"))
    return 1 if missing else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)), help="comma-separated seeds")
    p.add_argument("--steps", type=int, default=100, help="--num-rollout of each run")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time")
    p.add_argument("--threshold", type=float, default=0.8)
    p.add_argument("--out", required=True, help="folder of the runs (seed_<S>/ each)")
    p.add_argument("--summarise", action="store_true", help="only read the runs already in --out")
    p.add_argument("extra", nargs="*", help="after --: extra relax-train flags")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    out = Path(args.out)
    startup: dict[int, float | None] = {}
    if not args.summarise:
        startup = run_all(seeds, args.steps, max(1, args.parallel), out, args.extra)
    if (out / "startup.json").is_file():
        startup = {int(k): v for k, v in json.loads((out / "startup.json").read_text()).items()}
    return summarise(seeds, args.steps, args.threshold, out, startup)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
