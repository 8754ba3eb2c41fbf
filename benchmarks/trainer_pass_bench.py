"""The trainer's passes on the embedded default's shape, against the same passes in plain transformers (issue 18).

    .venv/bin/python benchmarks/trainer_pass_bench.py               # 6 rounds
    .venv/bin/python benchmarks/trainer_pass_bench.py --rounds 10

One process, one torch thread, a one-rank gloo group. The model is the embedded default's (2 layers, hidden 64,
vocabulary 320, built by `relax.models.embedded.build_embedded_assets`); the samples have its shape: 512 of a
20-token prompt and a 2-token answer (every eighth answer 1-8 tokens). Timed, side by side in rounds (medians):

  logprobs 512   `MegatronTrainer.compute_logprobs` of the 512 samples in micro-batches of 128 (the step's
                 reference and old-policy passes)
  update 128     one `MegatronTrainer.train_step` of 128 samples with the preset's loss (one of the step's 4)
  hf ...         the same passes on the transformers model: forward of [128, 24] token blocks, log-softmax of
                 the answer positions, and for the update backward + clip + AdamW (the floor of
                 benchmarks/plain_loop_bench.py's loop)

and the trainer with its LM head applied to every position (`--full-head`, the code before
relax.backends.megatron.response_positions) for comparison. Figures on 2 cores, load ~1 (2026-12-03):
logprobs 512 0.112 s (0.118 with the full head), update 128 0.074 s (0.088 with the full head).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _samples(count: int, prompt: int = 20):
    import torch

    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(count):
        resp = 2 if i % 8 else int(torch.randint(1, 9, (1,), generator=gen))
        out.append({"tokens": torch.randint(0, 256, (prompt + resp,), generator=gen), "response_length": resp,
                    "advantages": torch.randn(resp, generator=gen), "old_logprobs": -torch.rand(resp, generator=gen),
                    "ref_logprobs": -torch.rand(resp, generator=gen), "loss_mask": torch.ones(resp)})
    return out


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.backends.megatron import response_positions
    from relax.backends.megatron.testing import ensure_single_process, hf_trainer
    from relax.config import parse_config
    from relax.models.embedded import build_embedded_assets
    from relax.training.objective import PolicyObjective

    root = Path(tempfile.mkdtemp(prefix="trainer_pass_bench_"))
    config = parse_config(["--output-dir", str(root / "run")])  # the embedded default's settings
    build_embedded_assets(config.hf_checkpoint, config.prompt_data, seed=config.seed % 1000)
    ensure_single_process()
    pad = AutoTokenizer.from_pretrained(config.hf_checkpoint).pad_token_id
    trainer = hf_trainer(config.hf_checkpoint, micro_batch_size=config.micro_batch_size, lr=config.lr,
                         pad_token_id=pad)
    objective = PolicyObjective.from_config(config)
    samples = _samples(config.rollout_batch_size * config.n_samples_per_prompt)
    update = samples[:config.micro_batch_size]

    hf = AutoModelForCausalLM.from_pretrained(config.hf_checkpoint, dtype=torch.float32)
    opt = torch.optim.AdamW(hf.parameters(), lr=config.lr)
    ids = torch.randint(0, 256, (len(samples), 24))
    attn = torch.ones_like(ids)
    mbs = config.micro_batch_size

    def hf_logprobs():
        with torch.no_grad():
            for i in range(0, len(ids), mbs):
                hf(input_ids=ids[i:i + mbs], attention_mask=attn[i:i + mbs]).logits[:, 19:-1].float().log_softmax(-1)

    def hf_update():
        logits = hf(input_ids=ids[:mbs], attention_mask=attn[:mbs]).logits[:, 19:-1].float().log_softmax(-1)
        logits.gather(-1, ids[:mbs, 20:].unsqueeze(-1)).sum().backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    cut = response_positions.cut_applies
    variants = {
        "relax": (lambda: trainer.compute_logprobs(samples), lambda: trainer.train_step(update, objective)),
        "relax --full-head": (lambda: trainer.compute_logprobs(samples), lambda: trainer.train_step(update, objective)),
        "hf": (hf_logprobs, hf_update),
    }
    results: dict[str, list[list[float]]] = {name: [[], []] for name in variants}
    for _ in range(args.rounds):
        for name, (logprobs, step) in variants.items():
            response_positions.cut_applies = cut if name != "relax --full-head" else (lambda *a, **k: False)
            logprobs()  # warm (allocator, first-call paths)
            results[name][0].append(_median_time(logprobs, 2))
            results[name][1].append(_median_time(step, 3))
    response_positions.cut_applies = cut
    print(f"{'':20s} {'logprobs 512':>13s} {'update 128':>11s}")
    for name, (lp, up) in results.items():
        print(f"{name:20s} {statistics.median(lp):13.4f} {statistics.median(up):11.4f}")
    relax, floor = results["relax"], results["hf"]
    print(f"relax / hf: logprobs {statistics.median(relax[0]) / statistics.median(floor[0]):.2f}, "
          f"update {statistics.median(relax[1]) / statistics.median(floor[1]):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
