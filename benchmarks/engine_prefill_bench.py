"""Generation step of the embedded default, shared-prompt prefill on vs off: in one process, or through servers.

    .venv/bin/python benchmarks/engine_prefill_bench.py                 # 7 rounds, under a minute
    .venv/bin/python benchmarks/engine_prefill_bench.py --http        # through two server processes
    .venv/bin/python benchmarks/engine_prefill_bench.py --rounds 3 --profile shared

One step is what `relax-train` (no model flags) asks of its engine per rollout: 32 prompts x 16 samples (GRPO
groups, SGLang's `n`, each prompt's `sampling_seed` in the `sampling_seeds` label), temperature 1, at most 8
new tokens, as one batched /generate body. It goes through the server's own parsing (`build_requests`), the
engine (`max_running_requests` 256, one thread, as `relax.roles.engine.engine_server_args` starts it) and the
SGLang-shaped replies; only HTTP and JSON are left out, unless `--http`. The model is the embedded default's
(`relax.models.embedded.build_embedded_assets`), the prompts its task's, chat-templated.

Configurations: `shared` (the engine's default: identical prompts of an admitted group are prefilled once and
their KV rows copied, `relax.backends.embedded.prefix`) and `unshared` (`engine.share_prefill = False`: every
copy prefilled on its own row, as before). They take turns step by step on the same engine (`--http`: two
servers, the unshared one started with `--disable-radix-cache`), the order reversed every other round, and the
figures are medians, so the load of other jobs on this machine falls on both alike.

Measured on 2 cores shared with other jobs (load average 2-4), torch 2.13.0+cpu, default arguments, 9 rounds;
"head" is this script run in a checkout without this change (every copy prefilled, `tokenizer.decode` per
reply, one awaited future per request, no `gc.freeze`; `--no-gc-freeze` for the in-process figures), runs of
head and of this change taking turns. Seconds per step, the range of the runs' medians (of their means):

                  head                   shared                   unshared       unshared / shared
    in process    0.148-0.181 (0.20-0.22) 0.053-0.066 (0.055-0.076) 0.158-0.180    2.6-3.1x   (6 runs, head 4)
    --http        0.179-0.220 (0.26)      0.085-0.089 (0.085)*      0.194-0.210    2.3-2.4x   (4 runs each)

    * a fourth run caught a burst of load: shared 0.180, unshared 0.282 beside it (1.57x); in process, one head
      run under such load gave 0.473.

Head's means sit above its medians by the garbage collector's full collections (~0.2-0.25 s every ~5 steps,
scanning the ~400k objects of torch, transformers and the model), which `gc.freeze` at server start-up removes.
The scheduler's own CPU per step (cProfile, `--profile shared`) is now led by the seeded draws
(`sampling._seeded_picks`, one `exponential_` per row: ~1000 rows per step), then the replies (`_finish`).
Replies are bit-identical to head's (24 steps x 512 replies compared: tokens, text and log-probs): on this model
a prompt's row comes out of the prefill with the same bits whatever batch it is computed in, so a copied row is
the row the copy computed before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_prompts(engine, data_path: str) -> list[list[int]]:
    from relax.models.tasks import render_prompt

    rows = [json.loads(line) for line in Path(data_path).read_text().splitlines() if line.strip()]
    return [engine.tokenize(render_prompt(engine.tokenizer, row["input"])) for row in rows]


def step_body(prompts: list[list[int]], step: int, args) -> dict:
    """The batched /generate body of rollout step `step` (as relax.rollout.generate._post_batch sends it)."""
    chosen = [prompts[(step * args.prompts + i) % len(prompts)] for i in range(args.prompts)]
    seeds = [1_000_003 * step + 7919 * i for i in range(args.prompts)]
    return {"input_ids": chosen,
            "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 1.0, "n": args.samples},
            "return_logprob": True,
            "custom_labels": {"sampling_seeds": ",".join(str(s) for s in seeds)}}


def run_step(engine, body: dict) -> tuple[float, list[dict]]:
    from relax.backends.embedded.server import build_requests

    t0 = time.perf_counter()
    reqs, _ = build_requests(engine, body)
    submit_many = getattr(engine, "submit_many", None)
    futures = submit_many(reqs) if submit_many else [engine.submit(r) for r in reqs]
    replies = [f.result(600) for f in futures]
    return time.perf_counter() - t0, replies


def http_step(url: str, body: dict) -> tuple[float, list[dict]]:
    """One step through a server process: POST /generate and the parsed JSON replies."""
    import requests

    t0 = time.perf_counter()
    resp = requests.post(url + "/generate", json=body, timeout=600)
    resp.raise_for_status()
    replies = resp.json()
    return time.perf_counter() - t0, replies


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--http", action="store_true",
                    help="through server processes (`python -m relax.backends.embedded.server`, one per configuration, "
                         "unshared with --disable-radix-cache), HTTP and JSON included")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave start-up objects to the garbage collector (the server freezes them)")
    ap.add_argument("--profile", default=None,
                    help="cProfile the scheduler thread's work for this configuration (shared, unshared; "
                         "head: a checkout without shared-prompt prefill)")
    args = ap.parse_args(argv)

    import torch

    from relax.backends.embedded.engine import EmbeddedEngine
    from relax.models.embedded import build_embedded_assets

    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory()
    model_dir, data_path = f"{tmp.name}/model", f"{tmp.name}/train.jsonl"
    build_embedded_assets(model_dir, data_path, seed=args.seed)
    engine = EmbeddedEngine(model_dir, random_seed=args.seed, max_running_requests=args.max_running_requests)
    new_code = hasattr(engine, "share_prefill")
    configs = ["shared", "unshared"] if new_code else ["head"]
    servers: dict = {}
    if args.http:
        from relax.backends.embedded.launcher import EmbeddedServerProcess

        for cfg in configs:
            extra = {"disable_radix_cache": True} if cfg == "unshared" else {}
            servers[cfg] = EmbeddedServerProcess(model_dir, server_args={
                "random_seed": args.seed, "max_running_requests": args.max_running_requests, "num_threads": 1,
                **extra})
            servers[cfg].start()
        for proc in servers.values():
            proc.wait_healthy(180)
    else:
        engine.start()
    if not args.no_gc_freeze:
        import gc

        gc.collect()
        gc.freeze()  # what the server process does after start-up (relax.heap.freeze)
    times: dict[str, list[float]] = {c: [] for c in configs}
    tokens: dict[str, list[int]] = {c: [] for c in configs}
    prof = None
    if args.profile and not args.http:
        import cProfile

        prof = cProfile.Profile()
    try:
        prompts = load_prompts(engine, data_path)
        print(f"prompt tokens: {min(map(len, prompts))}-{max(map(len, prompts))}, {len(set(map(tuple, prompts)))} "
              f"distinct prompts in {len(prompts)} rows", flush=True)
        step = 0
        for rnd in range(args.warmup + args.rounds):
            order = configs if rnd % 2 == 0 else configs[::-1]
            for cfg in order:
                body = step_body(prompts, step, args)
                if args.http:
                    dt, replies = http_step(servers[cfg].url, body)
                else:
                    if new_code:
                        engine.share_prefill = cfg == "shared"
                    profiling = prof is not None and cfg == args.profile and rnd >= args.warmup
                    if profiling:
                        engine.call(prof.enable).result()  # the scheduler thread does the work
                    dt, replies = run_step(engine, body)
                    if profiling:
                        engine.call(prof.disable).result()
                if rnd >= args.warmup:
                    times[cfg].append(dt)
                    tokens[cfg].append(sum(len(r["output_ids"]) for r in replies))
            step += 1
    finally:
        engine.shutdown()
        for proc in servers.values():
            proc.stop()
        tmp.cleanup()
    med = {c: statistics.median(v) for c, v in times.items()}
    for c in configs:
        print(f"{c:9s} {med[c]:.4f} s/step (median of {len(times[c])}, mean {statistics.mean(times[c]):.4f}; all: "
              f"{', '.join(f'{x:.3f}' for x in times[c])}); {statistics.mean(tokens[c]):.0f} tokens/step")
    if len(configs) == 2:
        print(f"unshared / shared: {med['unshared'] / med['shared']:.2f}x")
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
