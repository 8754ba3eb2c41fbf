"""Throughput of synchronous and fully-async training, side by side with a plain single-process loop (issue 10).

    .venv/bin/python benchmarks/async_bench.py                          # embedded default, 12 steps each
    .venv/bin/python benchmarks/async_bench.py --steps 8 --skip-loop
    .venv/bin/python benchmarks/async_bench.py --model runs/smollm2/model --data F.jsonl --steps 6 \\
        --extra --input-key prompt --label-key label --rollout-batch-size 8 ...   # SmolLM2-135M (flags on every run)

One invocation runs, one after the other on the same task, model and batch settings (the embedded default's, or
the given model and data with --extra flags):

  sync          relax-train as configured (the synchronous loop)
  async S=1     the same with --fully-async --max-staleness 1
  async S=2     the same with --fully-async --max-staleness 2
  async S=1 fixed  async S=1 with RELAX_SHARE_IDLE_CORES=0: every process keeps its thread count (the trainer
                does not take the cores the rollout leaves idle, relax.wire.core_share)
  async S=1 K   with --chunks K: async S=1 with --num-iters-per-train-update K (each step streamed in K chunks)
  plain loop    benchmarks/plain_loop_bench.py's single-process loop (transformers generate + the same update,
                no Ray), from the same settings (the preset's, or --model/--data and --extra, its reward from
                --custom-rm-path when given)

For each: samples/s and s/step in the steady state (from the moment step `--warmup - 1` is logged to the last
step's record, timed by polling metrics.jsonl), the fraction of that wall time in which a rollout and a training
stage ran at once (async: from the steps' async/rollout_* and async/train_* times; sync: 0 by construction),
each role's CPU utilisation over the same window (CPU seconds of its processes / wall seconds: 1.0 is one core
busy; from psutil over the run's process tree), and the reward over the last three steps (every mode trains on
the same number of samples), and the trainer's mean thread count (perf/trainer_threads_mean; "fixed" where the
mode keeps it).

Machines are shared and noisy: read the ratios, printed at the end, and quote them with `uptime`. A 2-core VM's
speed moves by 10-20% within a minute, more than a mode's few-step runs can average out (the embedded default's
async/sync ratio came out 0.97-1.32x in five invocations within six minutes), so `--rounds N` runs the modes N
times, alternated (each round in the reverse order of the one before, so that neither mode always runs first), and
prints each round's ratios and their median: quote the median with its range.

    .venv/bin/python benchmarks/async_bench.py --steps 12 --warmup 3 --skip-loop --only sync "async S=1" --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from plain_loop_bench import run_loop  # noqa: E402  (the same loop issue 18's comparison uses)

MODES = {"sync": [], "async S=1": ["--fully-async", "--max-staleness", "1"],
         "async S=2": ["--fully-async", "--max-staleness", "2"],
         "async S=1 fixed": ["--fully-async", "--max-staleness", "1"]}
# environment of a mode beyond the benchmark's own: "fixed" keeps every process's thread count (the trainer does
# not take the cores the rollout leaves idle, relax.wire.core_share), for the side-by-side comparison
MODE_ENV = {"async S=1 fixed": {"RELAX_SHARE_IDLE_CORES": "0"}}


def _role(proc: psutil.Process) -> str:
    """Which role a process of the run's tree is (Ray names an actor's process `ray::Class.method`)."""
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    head = cmd[0] if cmd else ""
    if head.startswith("ray::"):
        name = head[5:].split(".")[0]
        return "idle worker" if name == "IDLE" else name
    text = " ".join(cmd)
    for key, name in (("embedded", "engine server"), ("sglang_router", "router"), ("sglang", "sglang"),
                      ("raylet", "ray"), ("gcs_server", "ray"), ("dashboard", "ray"), ("log_monitor", "ray"),
                      ("relax.entrypoints.train", "controller")):
        if key in text:
            return name
    return "other"


def _cpu_by_role(root: int) -> dict[str, float]:
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out: dict[str, float] = {}
    for p in procs:
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        role = _role(p)
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def run_mode(name: str, flags: list[str], steps: int, warmup: int, out: Path, env: dict | None = None) -> dict:
    """One relax-train run; its steady-state figures."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "relax.entrypoints.train", "--output-dir", str(out / "run"), "--num-rollout",
           str(steps), *flags]
    metrics = out / "run" / "metrics.jsonl"
    seen, marks = 0, []  # (wall time a record appeared, CPU seconds by role then)
    print(f"{name}: {' '.join(cmd[3:])}", flush=True)
    with open(out / "log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        while proc.poll() is None:
            lines = metrics.read_text().count("\n") if metrics.is_file() else 0
            if lines > seen:
                seen = lines
                marks.append((time.time(), lines, _cpu_by_role(proc.pid)))
            time.sleep(0.05)
    if proc.returncode != 0:
        print(f"  failed ({proc.returncode}); log: {out / 'log'}\n{(out / 'log').read_text()[-1500:]}", file=sys.stderr)
        return {}
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "perf/step_time" in r]
    start = next((m for m in marks if m[1] >= warmup), None)
    end = marks[-1]
    if start is None or end[1] <= start[1]:
        print("  too few steps for a steady state: raise --steps", file=sys.stderr)
        return {}
    wall = end[0] - start[0]
    counted = rows[start[1]:end[1]]
    samples = sum(r.get("samples/trained", r.get("rollout/num_samples", 0.0)) for r in counted)
    util = {role: (end[2].get(role, 0.0) - start[2].get(role, 0.0)) / wall for role in end[2]}
    return {"samples_per_s": samples / wall, "s_per_step": wall / len(counted), "overlap": _overlap(counted),
            "util": {k: v for k, v in sorted(util.items(), key=lambda kv: -kv[1]) if v >= 0.02},
            "reward": statistics.fmean(r["rollout/reward_mean"] for r in rows[-3:]),
            "staleness_max": max((r.get("async/staleness_max", 0.0) for r in counted), default=0.0),
            "threads": statistics.fmean(r.get("perf/trainer_threads_mean", 0.0) for r in counted)}


def _overlap(rows: list[dict]) -> float:
    """Fraction of the steps' span in which some rollout interval and some training interval overlap."""
    rollouts = [(r["async/rollout_start"], r["async/rollout_end"]) for r in rows if "async/rollout_start" in r]
    trains = [(r["async/train_start"], r["async/train_end"]) for r in rows if "async/train_start" in r]
    if not rollouts or not trains:
        return 0.0
    both = 0.0
    for a0, a1 in rollouts:
        for b0, b1 in trains:
            both += max(0.0, min(a1, b1) - max(a0, b0))
    span = max(e for _, e in rollouts + trains) - min(s for s, _ in rollouts + trains)
    return both / span if span > 0 else 0.0


def run_plain_loop(steps: int, warmup: int, extra: list[str], out: Path) -> dict:
    from relax.config import parse_config
    from relax.config.env import threads_per_process

    config = parse_config(["--output-dir", str(out / "loop"), *extra])
    threads = threads_per_process(config.resource["actor"][0] * config.resource["actor"][1])
    print(f"plain loop: {threads} torch thread(s)", flush=True)
    t0 = time.time()
    cpu0 = psutil.Process().cpu_times()
    recs = run_loop(config, steps, threads)
    counted = recs[warmup:] or recs
    wall = sum(r["step_time"] for r in counted)
    cpu1 = psutil.Process().cpu_times()
    samples = config.rollout_batch_size * config.n_samples_per_prompt
    return {"samples_per_s": samples * len(counted) / wall, "s_per_step": wall / len(counted), "overlap": 0.0,
            "util": {"loop process": (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / (time.time() - t0)},
            "reward": statistics.fmean(r["reward"] for r in recs[-3:]), "staleness_max": 0.0}


def _print_ratio(label: str, rounds: list[dict[str, dict]], top: str, bottom: str) -> None:
    """The samples/s ratio `top / bottom` of each round that ran both; with several rounds, their median first."""
    ratios = [r[top]["samples_per_s"] / r[bottom]["samples_per_s"] for r in rounds if r.get(top) and r.get(bottom)]
    if not ratios:
        return
    if len(rounds) == 1:
        print(f"{label}: {ratios[0]:.2f}")
    else:
        each = ", ".join(f"{x:.2f}" for x in ratios)
        print(f"{label}: median {statistics.median(ratios):.2f} over {len(ratios)} rounds ({each})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out before the steady state starts")
    p.add_argument("--model", default=None, help="--hf-checkpoint for every run (default: the embedded default)")
    p.add_argument("--data", default=None, help="--prompt-data for every run (with --model)")
    p.add_argument("--skip-loop", action="store_true")
    p.add_argument("--chunks", type=int, default=1,
                   help="also run async S=1 with --num-iters-per-train-update CHUNKS (needs a setting it allows: "
                        "no KL loss, one optimizer step per rollout)")
    p.add_argument("--only", nargs="*", default=None, help=f"modes to run, of {list(MODES)} (and 'async S=1 K=N')")
    p.add_argument("--keep", default=None, help="keep the run folders here")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the modes this many times, alternated; prints each round's ratios and their median")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more relax-train flags (every run)")
    args = p.parse_args()
    extra = list(args.extra)
    if args.model:
        extra = ["--hf-checkpoint", args.model, *(["--prompt-data", args.data] if args.data else []), *extra]
    if args.rounds < 1:
        p.error("--rounds takes a count >= 1")
    modes = dict(MODES)
    if args.chunks > 1:
        modes[f"async S=1 K={args.chunks}"] = [*MODES["async S=1"], "--num-iters-per-train-update", str(args.chunks)]
    chosen = [name for name in modes if args.only is None or name in args.only]
    if not args.skip_loop:
        chosen.append("plain loop")
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        for index in range(args.rounds):
            results: dict[str, dict] = {}
            folder = root / f"round{index + 1}" if args.rounds > 1 else root
            for name in (chosen if index % 2 == 0 else chosen[::-1]):
                print(f"uptime: {os.popen('uptime').read().strip()}")
                if name == "plain loop":
                    results[name] = run_plain_loop(args.steps, args.warmup, extra, folder)
                else:
                    results[name] = run_mode(name, [*extra, *modes[name]], args.steps, args.warmup,
                                             folder / name.replace(" ", "_").replace("=", ""), MODE_ENV.get(name))
            rounds.append({name: results[name] for name in chosen})
    print(f"uptime: {os.popen('uptime').read().strip()}\n")
    print(f"{'mode':<20}{'samples/s':>11}{'s/step':>9}{'overlap':>9}{'stale max':>10}{'reward':>8}{'threads':>9}"
          "  CPU utilisation")
    for index, results in enumerate(rounds):
        for name, r in results.items():
            label = f"{name} #{index + 1}" if args.rounds > 1 else name
            if not r:
                print(f"{label:<20}  (failed)")
                continue
            util = ", ".join(f"{k} {v:.2f}" for k, v in r["util"].items())
            threads = f"{r['threads']:.2f}" if r.get("threads") else "fixed"
            print(f"{label:<20}{r['samples_per_s']:>11.1f}{r['s_per_step']:>9.3f}{r['overlap']:>9.2f}"
                  f"{r['staleness_max']:>10.0f}{r['reward']:>8.3f}{threads:>9}  {util}")
    for name in chosen:
        if name != "sync":
            _print_ratio(f"{name} / sync samples/s", rounds, name, "sync")
    if "plain loop" in chosen:
        _print_ratio("sync / plain loop samples/s", rounds, "sync", "plain loop")
    return 0 if all(r for results in rounds for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
