"""What a second torch thread gives the trainer's update, and what an engine beside it costs: one
`MegatronTrainer.train_step` on an HF model folder, timed at 1 and at 2 threads, alternated (issue 40: fully-async's
trainer runs on one thread beside the engines and on two once they idle, relax.wire.core_share).

    .venv/bin/python benchmarks/trainer_threads_bench.py --model runs/smollm2/model    # 16 samples, 60 + 40 tokens
    .venv/bin/python benchmarks/trainer_threads_bench.py --model M --samples 16 --prompt 60 --response 40 --rounds 3
    .venv/bin/python benchmarks/trainer_threads_bench.py --model runs/smollm2/model --beside-engine

One process, a one-rank gloo group, the model's weights loaded, random tokens, the GRPO loss without KL (the
flags of examples/smollm2/run.sh: micro-batches of 4, lr 1e-6). Prints each update's wall and CPU seconds, then the
medians' speed-up (1-thread wall / 2-thread wall) and the second thread's CPU cost (2-thread CPU / 1-thread CPU).
Run it on an otherwise idle machine: the figures are the update's alone, without an engine beside it.

--beside-engine instead measures how much the two sides of fully-async's rollout phase slow each other on the
machine's shared caches and memory: the embedded engine's real server (`relax.backends.embedded.server`, one
thread, the same model) generates rollouts of `--samples` prompts of `--prompt` random tokens and `--gen-tokens`
new tokens (ignore_eos, temperature 1), in a loop from a thread of this process, while the update runs on one
thread; alternated with the update alone and the rollouts alone. Prints the update's and the rollout's time beside
the other against alone (1.00: no slowing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def _rollouts_beside(client, prompts, params, stop: threading.Event, times: list[float]) -> None:
    """Generate one rollout after the other until `stop` is set; record each finished rollout's seconds."""
    while not stop.is_set():
        t0 = time.perf_counter()
        client.generate(prompts, params)
        times.append(time.perf_counter() - t0)


def beside_engine(args, trainer, objective, samples) -> int:
    import torch

    from relax.backends.embedded.launcher import EmbeddedServerProcess
    from relax.wire.engine_client import EngineClient

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (args.prompt,), generator=gen).tolist() for _ in range(args.samples)]
    params = {"max_new_tokens": args.gen_tokens, "ignore_eos": True, "temperature": 1.0}
    server = EmbeddedServerProcess(args.model, server_args={"random_seed": 0, "num_threads": 1})
    server.start()
    try:
        server.wait_healthy(300)
        client = EngineClient(server.url, timeout_s=600)
        client.generate(prompts[:2], {"max_new_tokens": 4, "ignore_eos": True})  # first-call paths
        rows: dict[str, list[float]] = {"update alone": [], "update beside": [], "rollout alone": [],
                                        "rollout beside": []}
        for r in range(args.rounds):
            t0 = time.perf_counter()
            trainer.train_step(samples, objective)
            rows["update alone"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            client.generate(prompts, params)
            rows["rollout alone"].append(time.perf_counter() - t0)
            stop, done = threading.Event(), []
            loop = threading.Thread(target=_rollouts_beside, args=(client, prompts, params, stop, done), daemon=True)
            loop.start()
            time.sleep(0.3)  # the request reached the engine: it computes from here on
            t0 = time.perf_counter()
            trainer.train_step(samples, objective)
            rows["update beside"].append(time.perf_counter() - t0)
            beside = len(done)
            stop.set()
            loop.join()
            # rollouts that ended within the update (the first began 0.3 s before it; one in flight is left out)
            within = done[:beside] or done[-1:]
            rows["rollout beside"] += within
            print(f"round {r + 1}: update alone {rows['update alone'][-1]:.2f} s, beside the engine "
                  f"{rows['update beside'][-1]:.2f} s; rollout alone {rows['rollout alone'][-1]:.2f} s, beside the "
                  f"update {statistics.median(within):.2f} s", flush=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        print(f"beside the other against alone: update {med['update beside'] / med['update alone']:.2f}x the time, "
              f"rollout {med['rollout beside'] / med['rollout alone']:.2f}x (medians)", flush=True)
    finally:
        server.stop()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF model folder (e.g. runs/smollm2/model)")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--prompt", type=int, default=60, help="prompt tokens per sample")
    p.add_argument("--response", type=int, default=40, help="response tokens per sample")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--beside-engine", action="store_true",
                   help="the update on one thread beside the embedded engine's rollouts, against each alone")
    p.add_argument("--gen-tokens", type=int, default=48, help="with --beside-engine: new tokens per sample")
    args = p.parse_args()

    import torch
    from transformers import AutoConfig

    from relax.backends.megatron.testing import ensure_single_process, hf_trainer
    from relax.config import parse_config
    from relax.training.objective import PolicyObjective

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="trainer_threads_bench_"))
    data = root / "prompts.jsonl"
    data.write_text('{"input": "1", "label": "1"}\n')
    config = parse_config(["--output-dir", str(root / "run"), "--hf-checkpoint", args.model, "--prompt-data",
                           str(data), "--input-key", "input", "--label-key", "label", "--num-rollout", "1", "--micro-batch-size", str(args.micro_batch_size),
                           "--lr", "1e-6", "--rollout-batch-size", "1", "--n-samples-per-prompt", str(args.samples)])
    ensure_single_process()
    trainer = hf_trainer(args.model, micro_batch_size=args.micro_batch_size, lr=1e-6, pad_token_id=0)
    objective = PolicyObjective.from_config(config)
    gen = torch.Generator().manual_seed(0)
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    resp = args.response
    samples = [{"tokens": torch.randint(0, vocab, (args.prompt + resp,), generator=gen), "response_length": resp,
                "advantages": torch.randn(resp, generator=gen), "old_logprobs": -torch.rand(resp, generator=gen),
                "ref_logprobs": -torch.rand(resp, generator=gen), "loss_mask": torch.ones(resp)}
               for _ in range(args.samples)]
    trainer.train_step(samples[:args.micro_batch_size], objective)  # first-call paths, the allocator
    if args.beside_engine:
        return beside_engine(args, trainer, objective, samples)
    times: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            wall, cpu = time.perf_counter(), time.process_time()
            trainer.train_step(samples, objective)
            times[threads].append((time.perf_counter() - wall, time.process_time() - cpu))
            print(f"{threads} thread(s): {times[threads][-1][0]:.2f} s, {times[threads][-1][1]:.2f} CPU s", flush=True)
    wall = {n: statistics.median(t[0] for t in rows) for n, rows in times.items()}
    cpu = {n: statistics.median(t[1] for t in rows) for n, rows in times.items()}
    print(f"2 threads against 1: {wall[1] / wall[2]:.2f}x as fast, {cpu[2] / cpu[1]:.2f}x the CPU", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
