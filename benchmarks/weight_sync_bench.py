"""Weight-sync throughput per path (relax.weights.sync) against a real embedded engine, next to a plain memory copy.

    python benchmarks/weight_sync_bench.py [--models tiny smollm2-135m qwen2-0.5b] [--paths tensor ...] [--repeats 3]
                                           [--dtype bfloat16] [--buffer-mb 512] [--json out.json]

For each model shape a random HF model is written to a temporary folder and served by one embedded engine
(`python -m relax.backends.embedded.server`, same host). The trainer side holds the same-named tensors and
pushes them with each path, then checks that the engine reports the new weight version:

  tensor       /update_weights_from_tensor, relax_shm_bind (the default for embedded engines): one copy, the
               trainer writes every tensor once into a /dev/shm segment holding the model twice and the
               engine's parameters become views of the half just written (relax.weights.shm)
  tensor-chunked  relax_shm, two copies: one reused /dev/shm segment of --buffer-mb (two slots, writing
               overlaps the engine's copy into its parameters) described by a JSON manifest per chunk
  tensor-pickle  the same endpoint as real SGLang gets it: pickled flattened buckets of --buffer-mb
  disk         safetensors into a temporary folder (--tmp-dir, default the system one) + /update_weights_from_disk
  distributed  /update_weights_from_distributed: gloo broadcast over a group (joined once, before timing)

memcpy is `torch.Tensor.copy_` of every tensor into a preallocated buffer of the same bytes (this process).
After one warm-up push per path, --repeats rounds each time memcpy and then every path back to back (the
machine's load changes, a round's numbers are comparable); reported: the median seconds, GB/s = weight
bytes / median seconds (1 GB = 1e9 B), "x memcpy" = the median over rounds of path seconds / memcpy
seconds of the same round (the per-round ratios, and best path seconds / best memcpy seconds, are printed
too) and "bw ratio" = the median over rounds of memcpy seconds / path seconds, i.e. the path's bandwidth
as a fraction of a plain memory copy's (the weight-sync speed target: >= 0.5 on qwen2-0.5b for tensor).
Each push's seconds include the engine's answer and the weight-version check (`WeightSync.push`).

Shapes: tiny (relax.models.tiny), smollm2-135m (LlamaConfig hidden 576, 30 layers, 9 heads, 3 kv heads,
intermediate 1536, vocab 49152, tied) and qwen2-0.5b (Qwen2Config hidden 896, 24 layers, 14 heads, 2 kv heads,
intermediate 4864, vocab 151936, tied).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relax.backends.embedded.launcher import EmbeddedServerProcess  # noqa: E402
from relax.models.tiny import TinyArch, build_tiny_model_dir  # noqa: E402
from relax.weights.sync import make_weight_sync  # noqa: E402

SHAPES = {
    "smollm2-135m": ("llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                   intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                                   max_position_embeddings=2048)),
    "qwen2-0.5b": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                                 max_position_embeddings=2048)),
}


def build_model(name: str, folder: Path, dtype: torch.dtype) -> Path:
    """A random HF model of the named shape (with the tiny model's byte tokenizer)."""
    tiny = build_tiny_model_dir(folder / "tiny", TinyArch(family="qwen2"), seed=0)
    if name == "tiny":
        return tiny
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    family, kw = SHAPES[name]
    config = (LlamaConfig if family == "llama" else Qwen2Config)(**kw)
    config.torch_dtype = dtype
    out = folder / name
    out.mkdir(parents=True)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(0)
    state = {}
    for pname, p in meta.state_dict().items():
        if pname == "lm_head.weight" and config.tie_word_embeddings:
            continue
        t = torch.empty(p.shape, dtype=torch.float32)
        t.normal_(0.0, 0.02, generator=gen) if p.dim() > 1 else t.fill_(1.0)
        state[pname] = t.to(dtype)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy2(f, out / f.name)
    return out


def trainer_tensors(model_dir: Path, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    from relax.backends.embedded.server import load_hf_weights

    named = [(n, t.to(dtype).clone()) for n, t in load_hf_weights(str(model_dir))]
    return named


def memcpy_seconds(named, repeats: int, dst: torch.Tensor | None = None) -> float:
    """Best of repeats + 1 copies of every tensor into `dst` (pages faulted in before: pass one in, or the
    first, cold copy is one of the repeats)."""
    total = sum(t.numel() * t.element_size() for _, t in named)
    dst = torch.empty(total, dtype=torch.uint8) if dst is None else dst
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        off = 0
        for _, t in named:
            n = t.numel() * t.element_size()
            dst[off:off + n].view(t.dtype).copy_(t.reshape(-1))
            off += n
        best = min(best, time.perf_counter() - t0)
    return best


def engine_group(method: str) -> str:
    return "bind" if method == "tensor" else "copy"


def bench_model(name: str, args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    work = Path(tempfile.mkdtemp(prefix="relax-wsbench-"))
    rows = []
    try:
        t0 = time.perf_counter()
        model_dir = build_model(name, work, dtype)
        named = trainer_tensors(model_dir, dtype)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        print(f"# {name}: {len(named)} tensors, {nbytes / 1e6:.1f} MB {args.dtype} "
              f"(built in {time.perf_counter() - t0:.0f}s)", flush=True)
        # The one-copy path leaves the engine's parameters as views of its segment, and a copying path
        # then first gives them private memory again (and the next bind frees it): alternating them on one
        # engine would time that churn, not either path. So "tensor" gets an engine of its own.
        groups = sorted({engine_group(m) for m in args.paths})
        servers = {g: EmbeddedServerProcess(str(model_dir), server_args={
            "dtype": args.dtype, "random_seed": 0, "num_threads": args.engine_threads}) for g in groups}
        for server in servers.values():
            server.start()
        syncs = {}
        try:
            for server in servers.values():
                server.wait_healthy(600)
            cold, modes = {}, {}
            for method in args.paths:
                extra = {"tensor-pickle": {"use_shm": False},
                         "tensor-chunked": {"shm_mode": "chunked"}}.get(method, {})
                syncs[method] = make_weight_sync(method.split("-")[0], [servers[engine_group(method)].url],
                                                 buffer_bytes=args.buffer_mb << 20, timeout_s=900,
                                                 tmp_dir=args.tmp_dir, **extra)
                t0 = time.perf_counter()
                syncs[method].push(named, f"{method}-warmup")  # staging buffers / group set up here
                cold[method] = time.perf_counter() - t0
                modes[method] = getattr(syncs[method], "last_mode", None) or method
            # rounds: memcpy and every path back to back, so that each ratio compares like with like on a
            # machine whose load changes
            times = {m: [] for m in ["memcpy", *args.paths]}
            parts = {m: [] for m in args.paths}
            dst = torch.zeros(nbytes, dtype=torch.uint8)  # faulted in once, like the paths' reused buffers
            for i in range(args.repeats):
                times["memcpy"].append(memcpy_seconds(named, 0, dst))
                for method in args.paths:
                    report = syncs[method].push(named, f"{method}-{i}")
                    times[method].append(report["seconds"])
                    parts[method].append({**getattr(syncs[method], "last_timing", {}),
                                          "verify_s": report.get("verify_seconds")})
        finally:
            for sync in syncs.values():
                sync.close()
            for server in servers.values():
                server.stop()
        for method, ts in times.items():
            ratios = [t / m for t, m in zip(ts, times["memcpy"])]
            bw = [m / t for t, m in zip(ts, times["memcpy"])]
            sec = statistics.median(ts)
            rows.append({"model": name, "path": method, "mode": modes.get(method, method), "bytes": nbytes,
                         "seconds": sec, "all_seconds": ts,
                         "gb_per_s": nbytes / sec / 1e9, "x_memcpy": statistics.median(ratios),
                         "x_memcpy_all": ratios, "x_memcpy_best": min(ts) / min(times["memcpy"]),
                         "bw_ratio": statistics.median(bw), "bw_ratio_all": bw,
                         "first_seconds": cold.get(method)})
            r = rows[-1]
            print(f"  {method:14s} {sec:8.4f}s  {r['gb_per_s']:7.2f} GB/s  {r['x_memcpy']:6.2f}x memcpy  "
                  f"bw ratio {r['bw_ratio']:.2f} (rounds {', '.join(f'{x:.2f}' for x in bw)}; best/best "
                  f"{1 / r['x_memcpy_best']:.2f})" + (f"  [{r['mode']}] first push {cold[method]:.3f}s"
                                                       if method in cold else ""), flush=True)
            if method != "memcpy" and parts[method] and "write_s" in parts[method][0]:
                r["parts"] = parts[method]
                print("    where the time goes (median s): " + ", ".join(
                    f"{k} {statistics.median(p[k] for p in parts[method]):.4f}"
                    for k in parts[method][0] if all(p.get(k) is not None for p in parts[method])), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m", "qwen2-0.5b"],
                   choices=["tiny", *SHAPES])
    p.add_argument("--paths", nargs="+", default=["tensor", "tensor-chunked", "tensor-pickle", "disk", "distributed"],
                   choices=["tensor", "tensor-chunked", "tensor-pickle", "disk", "distributed"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--buffer-mb", type=int, default=512)
    p.add_argument("--engine-threads", type=int, default=1)
    p.add_argument("--tmp-dir", default=None, help="where the disk path writes (default: the system temp dir)")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        rows.extend(bench_model(name, args))
    print("\nmodel          path             seconds      GB/s   x memcpy  bw ratio (medians)")
    for r in rows:
        print(f"{r['model']:14s} {r['path']:14s} {r['seconds']:8.4f} {r['gb_per_s']:9.2f} {r['x_memcpy']:9.2f} "
              f"{r['bw_ratio']:9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
