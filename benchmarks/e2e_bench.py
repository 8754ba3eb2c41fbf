"""End-to-end throughput of the synchronous GRPO loop on this machine.

    .venv/bin/python benchmarks/e2e_bench.py                       # tiny model (embedded default task)
    .venv/bin/python benchmarks/e2e_bench.py --model DIR --data F  # e.g. SmolLM2 (scripts/convert_smollm2.py)
    .venv/bin/python benchmarks/e2e_bench.py --metrics runs/smollm2/metrics.jsonl  # summarise a finished run

Runs `relax-train` for --steps steps and prints, from metrics.jsonl (first step excluded as warm-up):
steps/s, samples/s, rollout tokens/s, train tokens/s, weight-sync seconds and bytes/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(extra: list[str], steps: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "relax.entrypoints.train", "--output-dir", str(out), "--num-rollout", str(steps),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarise(name: str, records: list[dict]) -> None:
    rows = records[1:] or records
    mean = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    step = mean("perf/step_time")
    print(f"== {name}: {len(rows)} measured steps ==")
    print(f"steps/s            {1 / step:.3f}   (step {step:.2f} s: rollout {mean('perf/rollout_time'):.2f}, "
          f"train {mean('perf/train_time'):.2f}, weight sync {mean('perf/weight_sync_time'):.3f})")
    print(f"samples/s          {mean('rollout/num_samples') / step:.1f}")
    print(f"rollout tokens/s   {mean('rollout/tokens') / mean('perf/rollout_time'):.1f} (response tokens / rollout time)")
    print(f"train tokens/s     {mean('train/tokens') / mean('perf/train_time'):.1f} (prompt+response tokens / train time)")
    print(f"weight sync        {mean('perf/weight_sync_time'):.3f} s, {mean('perf/weight_sync_bytes') / 1e6:.2f} MB, "
          f"{mean('perf/weight_sync_bytes_per_s') / 1e9:.3f} GB/s")
    print(f"reward             {rows[0]['rollout/reward_mean']:.3f} -> {rows[-1]['rollout/reward_mean']:.3f}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--model", default=None, help="HF model folder (default: the embedded tiny model)")
    p.add_argument("--data", default=None, help="prompt JSONL with input/label (needed with --model)")
    p.add_argument("--metrics", default=None, help="only summarise this metrics.jsonl of a finished run")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args()
    if args.metrics:
        summarise(args.metrics, [json.loads(x) for x in Path(args.metrics).read_text().splitlines() if '"step"' in x])
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            extra = ["--hf-checkpoint", args.model, "--prompt-data", args.data, "--apply-chat-template",
                     "--rm-type", "math", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                     "--rollout-max-response-len", "32", "--micro-batch-size", "4", "--lr", "1e-6",
                     "--lr-decay-style", "constant", "--distributed-backend", "gloo", *args.extra]
            summarise(f"model {args.model}", run(extra, args.steps, Path(tmp)))
        else:
            summarise("tiny (embedded default)", run(args.extra, args.steps, Path(tmp)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
