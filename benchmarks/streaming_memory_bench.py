"""Resident memory of the prompt data source: streaming (`--use-streaming-dataset`) vs eager.

    .venv/bin/python benchmarks/streaming_memory_bench.py                  # 2,000,000 streamed, 200,000 eager
    .venv/bin/python benchmarks/streaming_memory_bench.py --prompts 500000 --eager-prompts 100000 --keep

Writes a JSONL prompt file (default in a fresh folder under /tmp, or under --workdir; deleted at the end
unless --keep), then reads it once through `relax.rollout.data_source.PromptDataSource` in rollout
batches of --batch prompts (the batches are dropped, as a rollout step would drop its prompts), sampling
the process's resident set size (/proc/self/statm) after every batch. Each mode runs in its own child
process, so one mode's heap cannot hide or inflate the other's.

Printed per mode: RSS after the imports, after building the source (eager mode loads the whole file
here), at 10%, 50% and 100% of the file, the peak, and the slope of RSS over the second half of the pass
(MB per million prompts, least squares). Streaming must be flat: its slope should be ~0 and its RSS
independent of the file size; eager mode holds every record, so its RSS grows with the file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1024 * 1024


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / MB


def write_prompts(path: str, n: int) -> float:
    """A JSONL file of n prompts shaped like the task data (prompt, label, metadata); returns its size in MB."""
    chunk = 50_000
    with open(path, "w") as f:
        for start in range(0, n, chunk):
            f.write("".join(
                json.dumps({"prompt": f"Question {i}: what is {i % 977} + {i % 613}? Answer with a number.",
                            "label": str(i % 977 + i % 613), "metadata": {"id": i, "source": "bench"}}) + "\n"
                for i in range(start, min(n, start + chunk))))
    return os.path.getsize(path) / MB


def slope_mb_per_million(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (prompts read, RSS MB), in MB per 1,000,000 prompts."""
    if len(points) < 2:
        return 0.0
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx * 1e6


def child(path: str, streaming: bool, n: int, batch: int, buffer_size: int, shuffle: bool, passes: int = 1) -> dict:
    """`passes` passes over the file in this process; returns the RSS figures (10/50/100%: of the first pass)."""
    from relax.rollout.data_source import PromptDataSource

    rss_import = rss_mb()
    t0 = time.perf_counter()
    source = PromptDataSource(path, input_key="prompt", label_key="label", metadata_key="metadata",
                              streaming=streaming, buffer_size=buffer_size, shuffle=shuffle, rollout_seed=1)
    rss_built = rss_mb()
    t_built = time.perf_counter() - t0
    num_batches = -(-n // batch)
    marks = {max(1, round(num_batches * f)): f for f in (0.1, 0.5, 1.0)}
    at: dict[str, float] = {}
    points: list[tuple[int, float]] = []
    peak = rss_built
    served = 0
    last_index = -1
    for b in range(1, passes * num_batches + 1):
        records = source.get_batch(min(batch, n - served % n))
        served += len(records)
        last_index = records[-1].index
        del records  # a rollout step drops its prompts once its samples are built
        r = rss_mb()
        peak = max(peak, r)
        points.append((served, r))
        if b in marks:
            at[f"{int(marks[b] * 100)}%"] = r
    elapsed = time.perf_counter() - t0
    second_half = [p for p in points if n // 2 <= p[0] <= n]
    later = [p for p in points if p[0] > n]
    return {"mode": "streaming" if streaming else "eager", "prompts": n, "served": served, "epoch": source.epoch,
            "last_index": last_index, "rss_import": rss_import, "rss_built": rss_built, "build_s": t_built,
            "at": at, "peak": peak, "slope_second_half": slope_mb_per_million(second_half),
            "slope_all": slope_mb_per_million([p for p in points if p[0] <= n]), "passes": passes,
            "slope_later_passes": slope_mb_per_million(later) if later else None,
            "rss_end": points[-1][1], "seconds": elapsed}


def run_child(path: str, streaming: bool, n: int, args: argparse.Namespace, passes: int = 1) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", path, "--child-n", str(n), "--passes", str(passes),
           "--batch",
           str(args.batch), "--buffer-size", str(args.buffer_size)] + (["--streaming"] if streaming else []) + (
           ["--shuffle"] if args.shuffle else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        sys.exit(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(r: dict, size_mb: float) -> None:
    at = r["at"]
    print(f"== {r['mode']}: {r['prompts']:,} prompts ({size_mb:.0f} MB file), served {r['served']:,} "
          f"in {r['seconds']:.1f} s ({r['served'] / r['seconds']:,.0f} prompts/s), last index {r['last_index']:,}")
    print(f"   RSS MB  imports {r['rss_import']:.1f} | built {r['rss_built']:.1f} (in {r['build_s']:.1f} s) | "
          f"10% {at.get('10%', float('nan')):.1f} | 50% {at.get('50%', float('nan')):.1f} | "
          f"100% {at.get('100%', float('nan')):.1f} | peak {r['peak']:.1f}")
    print(f"   slope   {r['slope_second_half']:+.2f} MB per million prompts (50%..100%), "
          f"{r['slope_all']:+.2f} over the whole pass; peak above imports: {r['peak'] - r['rss_import']:.1f} MB")
    if r["slope_later_passes"] is not None:
        print(f"   passes 2..{r['passes']} (next epochs): slope {r['slope_later_passes']:+.2f} MB per million prompts, "
              f"RSS at the end {r['rss_end']:.1f} MB")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=2_000_000, help="prompts in the streamed file")
    p.add_argument("--eager-prompts", type=int, default=200_000, help="prompts in the eager (non-streaming) file")
    p.add_argument("--batch", type=int, default=256, help="prompts per rollout batch (get_batch)")
    p.add_argument("--buffer-size", type=int, default=10_000, help="--streaming-buffer-size")
    p.add_argument("--shuffle", action="store_true", help="--rollout-shuffle (block shuffle in streaming mode)")
    p.add_argument("--workdir", default=None, help="where the files go (default: a new folder in /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-n", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--passes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--eager-passes", type=int, default=2,
                   help="passes (epochs) over the eager file: the first deep-copies each record once (see the end)")
    p.add_argument("--streaming", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.streaming, args.child_n, args.batch, args.buffer_size, args.shuffle,
                              args.passes)))
        return 0

    work = args.workdir or tempfile.mkdtemp(prefix="relax-stream-bench-")
    os.makedirs(work, exist_ok=True)
    big = os.path.join(work, f"prompts_{args.prompts}.jsonl")
    small = os.path.join(work, f"prompts_{args.eager_prompts}.jsonl")
    try:
        t0 = time.perf_counter()
        big_mb = write_prompts(big, args.prompts)
        small_mb = write_prompts(small, args.eager_prompts)
        print(f"wrote {big} ({big_mb:.0f} MB) and {small} ({small_mb:.0f} MB) in {time.perf_counter() - t0:.1f} s; "
              f"batch {args.batch}, buffer size {args.buffer_size}, shuffle {args.shuffle}")
        runs = [
            (run_child(big, True, args.prompts, args), big_mb),
            (run_child(small, True, args.eager_prompts, args), small_mb),
            (run_child(small, False, args.eager_prompts, args, args.eager_passes), small_mb),
        ]
        for r, size in runs:
            report(r, size)
        stream_big, stream_small, eager_small = (r for r, _ in runs)
        per_prompt = (eager_small["peak"] - eager_small["rss_import"]) * MB / eager_small["prompts"]
        print(f"streaming peak above imports: {stream_big['peak'] - stream_big['rss_import']:.1f} MB for "
              f"{args.prompts:,} prompts vs {stream_small['peak'] - stream_small['rss_import']:.1f} MB for "
              f"{args.eager_prompts:,} (flat: independent of the file size)")
        print(f"eager holds {per_prompt:.0f} bytes/prompt: {args.prompts:,} prompts would need about "
              f"{per_prompt * args.prompts / MB:,.0f} MB")
        print("eager's growth while serving its first epoch is one-time: each stored record is deep-copied when "
              "served, and on CPython 3.11 the first copy materializes the stored record's instance __dict__ "
              "(~64 B, kept with the record); later epochs stay flat (slope above).")
    finally:
        if args.keep:
            print(f"kept {work}")
        elif args.workdir:
            for f in (big, small):
                if os.path.exists(f):
                    os.remove(f)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
