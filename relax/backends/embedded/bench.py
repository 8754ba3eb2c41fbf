"""Measure the embedded engine over HTTP: decode throughput (single vs batched) and weight-update time.

    python -m relax.backends.embedded.bench [--model-path DIR] [--batch 64] [--new-tokens 128]

Without --model-path a tiny random Qwen2 model is built in a temporary folder. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import torch

    from relax.backends.embedded.launcher import EmbeddedServerProcess
    from relax.wire.engine_client import EngineClient
    from relax.wire.net import find_free_port
    from relax.weights.distributed import WeightUpdateGroup

    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory()
    path = args.model_path
    if path is None:
        from relax.models.tiny import TinyArch, build_tiny_model_dir

        path = str(build_tiny_model_dir(f"{tmp.name}/tiny", TinyArch(family="qwen2"), seed=0))
    proc = EmbeddedServerProcess(path, server_args={"random_seed": 0, "max_running_requests": max(64, args.batch)})
    proc.start()
    out: dict = {"model_path": path}
    try:
        proc.wait_healthy(120)
        c = EngineClient(proc.url, timeout_s=600)
        sp = {"max_new_tokens": args.new_tokens, "ignore_eos": True, "temperature": 1.0}
        prompt = list(range(1, args.prompt_len + 1))
        c.generate(prompt, {"max_new_tokens": 8, "ignore_eos": True})  # warm-up

        t0 = time.perf_counter()
        r = c.generate(prompt, sp, return_logprob=True)
        dt = time.perf_counter() - t0
        out["single_tok_per_s"] = round(len(r["output_ids"]) / dt, 1)

        prompts = [[(i * 7 + j) % 250 + 1 for j in range(args.prompt_len)] for i in range(args.batch)]
        t0 = time.perf_counter()
        rs = c.generate(prompts, sp, return_logprob=True)
        dt = time.perf_counter() - t0
        out[f"batch{args.batch}_tok_per_s"] = round(sum(len(x["output_ids"]) for x in rs) / dt, 1)

        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
        out["num_params"] = sum(t.numel() for _, t in named)
        times = []
        for i in range(args.repeats):
            times.append(c.update_weights_from_tensor(named, weight_version=f"t{i}")["seconds"])
        out["update_tensor_s_median"] = round(statistics.median(times), 4)
        times = []
        for i in range(args.repeats):
            t0 = time.perf_counter()
            c.update_weights_from_disk(path, weight_version=f"d{i}")
            times.append(time.perf_counter() - t0)
        out["update_disk_s_median"] = round(statistics.median(times), 4)
        group = WeightUpdateGroup([c], master_address="127.0.0.1", master_port=find_free_port(), backend="gloo")
        t0 = time.perf_counter()
        group.init()
        out["dist_init_s"] = round(time.perf_counter() - t0, 4)
        times = []
        try:
            for i in range(args.repeats):
                t0 = time.perf_counter()
                group.update(named, weight_version=f"g{i}")
                times.append(time.perf_counter() - t0)
        finally:
            group.destroy()
        out["update_distributed_s_median"] = round(statistics.median(times), 4)
    finally:
        proc.stop()
        tmp.cleanup()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
