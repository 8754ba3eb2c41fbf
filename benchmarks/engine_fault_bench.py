"""Detection latency and recovery time of --use-fault-tolerance for a killed and a hung rollout engine.

    python benchmarks/engine_fault_bench.py [--interval 1] [--timeout 5] [--steps 2] [--out /tmp/relax-fault-bench]

Each fault kind is one `relax-train` run of the embedded default (tiny model, CPU) with 2 engines; the
test-only fault injection (RELAX_TEST_ENGINE_FAULT, relax.rollout.fault_injection) kills (SIGKILL) or stops
(SIGSTOP) engine 1 while it holds requests in step 1. From the run's metrics.jsonl:

  detect   seconds from the signal to the engine's removal (engines/detect_s): a probe of /health_generate
           fails at once for a dead engine, after --rollout-health-check-timeout for a hung one, and probes
           run every --rollout-health-check-interval
  recover  seconds from the removal to the replacement serving again, at the current weight version, behind
           the router (engines/recover_s): an engine start from --hf-checkpoint plus the weight push
  run      the run's wall time (it must finish: exit 0)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(kind: str, args: argparse.Namespace) -> dict:
    out = Path(args.out) / kind
    shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl is appended to: start from an empty folder
    cmd = [sys.executable, "-m", "relax.entrypoints.train", "--num-rollout", str(args.steps),
           "--resource", '{"actor": [1, 1], "rollout": [1, 2]}', "--rollout-max-response-len", "96",
           "--use-fault-tolerance", "--rollout-health-check-interval", str(args.interval),
           "--rollout-health-check-timeout", str(args.timeout), "--output-dir", str(out)]
    env = dict(os.environ, RELAX_TEST_ENGINE_FAULT=f"{kind}:engine=1:step=1", RELAX_PROGRESS="0")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.run_timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{kind}: relax-train exited {proc.returncode}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    detect = [r["engines/detect_s"] for r in records if "engines/detect_s" in r]
    recover = [r["engines/recover_s"] for r in records if "engines/recover_s" in r]
    return {"kind": kind, "detect_s": detect[0] if detect else None, "recover_s": recover[0] if recover else None,
            "run_s": wall, "steps": len(records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=20, help="steps of each run (the fault is in step 1; the "
                        "replacement must be back before the run ends to be measured)")
    parser.add_argument("--out", default="/tmp/relax-fault-bench")
    parser.add_argument("--run-timeout", type=float, default=900.0)
    args = parser.parse_args()
    print(f"probes every {args.interval:g} s, timeout {args.timeout:g} s")
    print(f"{'fault':<6} {'detect s':>9} {'recover s':>10} {'run s':>7} {'steps':>6}")
    for kind in ("kill", "hang"):
        r = run(kind, args)
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        print(f"{kind:<6} {fmt(r['detect_s']):>9} {fmt(r['recover_s']):>10} {r['run_s']:>7.1f} {r['steps']:>6}")


if __name__ == "__main__":
    main()
