"""LoRA against full fine-tuning: bytes and seconds per weight push, trainer memory, step time (docs/lora.md).

    python benchmarks/lora_bench.py [--models embedded smollm2-135m] [--ranks 8 16 64] [--repeats 3] [--json out.json]

For each model shape (the embedded default's model, relax.models.embedded; SmolLM2-135M's shape with random
weights, benchmarks/weight_sync_bench.py) one embedded engine server serves it (fp32, same host), and a one-rank
Megatron trainer (gloo, this process) pushes to it:

  full      the trainer without LoRA: its weights through the run's push (relax.weights.sync.push_for_config, the
            tensor path's default for an embedded engine)
  merged    --lora-rank R --lora-merge-sync: the same push of W + alpha/r * B@A (what a LoRA run does today)
  adapter   adapter-only sync (relax.backends.megatron.lora_sync.push_adapter): the PEFT adapter written to a
            folder and loaded by the engine (/load_lora_adapter), checksum verified; not used by runs yet

Seconds per push: the median of --repeats pushes after one warm-up, export / merge / write included, until the
engine has answered. Bytes: what crosses to the engine (full/merged: the weights' bytes; adapter: the
adapter file's size). Trainer memory and step time: each mode in a fresh child process (`--child`), the resident
set size (RSS) after the model is built and loaded and after --steps training steps on toy samples (the optimizer
state exists from the first step), and the median step seconds.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(name: str, folder: Path) -> Path:
    import torch

    if name == "embedded":
        from relax.models.embedded import build_embedded_assets

        build_embedded_assets(str(folder / "model"), str(folder / "train.jsonl"), seed=0)
        return folder / "model"
    from weight_sync_bench import build_model

    return build_model(name, folder, torch.float32)


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def child(model_dir: str, rank: int, steps: int) -> dict:
    """One mode's trainer memory and step time (run in a fresh process)."""
    import torch

    from relax.backends.megatron.lora import LoraSettings
    from relax.backends.megatron.testing import ensure_single_process, hf_trainer, toy_pg_loss, toy_samples

    torch.set_num_threads(1)
    ensure_single_process()
    start = _rss_mb()
    lora = LoraSettings(rank=rank, alpha=16.0) if rank else None
    trainer = hf_trainer(model_dir, lr=1e-4, micro_batch_size=4, lora=lora)
    built = _rss_mb()
    samples = toy_samples(8, seed=0, vocab=250, min_len=48, max_len=64)
    seconds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(samples, toy_pg_loss)
        seconds.append(time.perf_counter() - t0)
    trainable = sum(p.numel() for p in trainer.gpt_model.parameters() if p.requires_grad)
    return {"rss_start_mb": start, "rss_built_mb": built, "rss_trained_mb": _rss_mb(),
            "step_s": statistics.median(seconds[1:] or seconds), "trainable_params": trainable}


def push_rows(model_dir: Path, ranks: list[int], repeats: int, folder: Path) -> list[dict]:
    from relax.backends.embedded.launcher import EmbeddedServerProcess
    from relax.backends.megatron.lora import LoraSettings
    from relax.backends.megatron.lora_sync import push_adapter
    from relax.backends.megatron.testing import ensure_single_process, hf_trainer
    from relax.weights.sync import push_for_config

    ensure_single_process()
    server = EmbeddedServerProcess(str(model_dir), server_args={"random_seed": 0})
    server.start()
    rows, version = [], 0
    try:
        server.wait_healthy(300)

        def timed(push) -> tuple[float, int]:
            nonlocal version
            seconds, size = [], 0
            for i in range(repeats + 1):  # the first is a warm-up
                version += 1
                t0 = time.perf_counter()
                size = push(version)
                if i:
                    seconds.append(time.perf_counter() - t0)
            return statistics.median(seconds), size

        def merged_push(trainer):
            def push(v):
                named = list(trainer.export_hf_weights())
                push_for_config(named, [server.url], v, {})
                return sum(t.numel() * t.element_size() for _, t in named)
            return push

        full = hf_trainer(model_dir, lr=1e-4)
        s, b = timed(merged_push(full))
        rows.append({"mode": "full", "rank": 0, "bytes": b, "seconds": s})
        del full
        for rank in ranks:
            trainer = hf_trainer(model_dir, lr=1e-4, lora=LoraSettings(rank=rank, alpha=16.0))
            s, b = timed(merged_push(trainer))
            rows.append({"mode": "merged", "rank": rank, "bytes": b, "seconds": s})
            s, b = timed(lambda v: push_adapter(trainer, [server.url], folder / f"r{rank}", v)["bytes"])
            rows.append({"mode": "adapter", "rank": rank, "bytes": b, "seconds": s})
            del trainer
    finally:
        server.stop()
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["embedded", "smollm2-135m"], choices=["embedded", "smollm2-135m"])
    p.add_argument("--ranks", nargs="+", type=int, default=[8, 16, 64])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="training steps of each memory / step-time child")
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "RANK"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.steps)))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model_dir = build(name, Path(tmp) / name)
            pushes = push_rows(model_dir, args.ranks, args.repeats, Path(tmp) / name / "adapters")
            memory = {}
            for rank in [0, *args.ranks]:
                out = subprocess.run([sys.executable, __file__, "--child", str(model_dir), str(rank), "--steps",
                                      str(args.steps)], capture_output=True, text=True, check=True,
                                     env={**os.environ, "PYTHONWARNINGS": "ignore"})
                memory["full" if rank == 0 else f"lora r={rank}"] = json.loads(out.stdout.strip().splitlines()[-1])
            results[name] = {"pushes": pushes, "trainer": memory}
            full = pushes[0]
            print(f"\n{name}: weight push (median of {args.repeats})")
            print(f"  {'mode':<8} {'rank':>4} {'MB':>10} {'x full':>8} {'seconds':>8}")
            for r in pushes:
                print(f"  {r['mode']:<8} {r['rank']:>4} {r['bytes'] / 1e6:>10.3f} {r['bytes'] / full['bytes']:>8.4f} "
                      f"{r['seconds']:>8.3f}")
            print(f"{name}: trainer (one rank, fp32; {args.steps} steps of 8 samples of 48-64 tokens)")
            print(f"  {'mode':<10} {'trainable':>11} {'RSS built MB':>13} {'RSS trained MB':>15} {'step s':>7}")
            for mode, m in memory.items():
                print(f"  {mode:<10} {m['trainable_params']:>11} {m['rss_built_mb']:>13.0f} {m['rss_trained_mb']:>15.0f} "
                      f"{m['step_s']:>7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
