"""The embedded default's step, in a plain single-process loop and in `relax-train`, side by side (issue 18 item 3).

    .venv/bin/python benchmarks/plain_loop_bench.py                 # both, 10 steps each
    .venv/bin/python benchmarks/plain_loop_bench.py --steps 6 --skip-relax
    .venv/bin/python benchmarks/plain_loop_bench.py --steps 8 --rounds 3   # relax, loop, relax, loop, ...
    .venv/bin/python benchmarks/plain_loop_bench.py --steps 3 --warmup 1 --extra <examples/smollm2/run.sh's flags>

With `--extra` model and data flags both sides run that model instead (SmolLM2-135M: the flags of
examples/smollm2/run.sh, its --custom-rm-path reward; the fully-async issue's floor on that model).

The loop is the floor `relax-train` must beat: no Ray, no HTTP, no data plane. Per step it does the same work
as the embedded default (`relax-train --output-dir DIR`, no model or data flags): the same tiny model,
tokenizer and prompts (`build_embedded_assets`), `rollout_batch_size` prompts x `n_samples_per_prompt`
answers sampled with `model.generate` (temperature, `rollout_max_response_len` new tokens), the exact-match
reward, GRPO advantages, old log-probs recomputed (the preset makes several optimizer steps per rollout),
reference log-probs from a frozen copy of the initial model (the preset's KL loss), then
`num_steps_per_rollout` AdamW steps of `global_batch_size` samples in micro-batches of `micro_batch_size`,
with Relax's own loss (`relax.training.objective.PolicyObjective`) and grad clipping. Weight sync is free
(one process). Settings are read from `relax.config.parse_config`, so a preset change moves both sides.

Phases (medians over steps, the first `--warmup` excluded):
  generate  relax: perf/rollout_generate_time (engine requests + reward); loop: generate + decode + reward
  ref       relax: perf/ref_logprob_time (its reference process, from the stage's call to the last reference
            rows, which arrive while the updates run: it overlaps `train`);  loop: frozen-copy forward
  train     relax: perf/train_compute_time (advantages, the old log-probs the rank computes itself, updates; with
            several updates per rollout the later updates' old log-probs come from the reference process on the
            other core, relax/roles/step_passes.py); loop: advantages, old log-probs, updates
  sync      relax: perf/weight_sync_time;  loop: 0
  other     step time minus the above (relax: Ray calls, data plane, metrics, less the overlap of `ref`, so
            negative; loop: prompt sampling/encoding)

Threads: the loop defaults to what a Relax trainer actor gets (`relax.config.env.threads_per_process`: the cores
less one, shared by the trainer ranks; 1 on a 2-core machine). On a loaded machine two OpenMP threads per process are far slower than one (measured on
2 cores at load ~15: loop step 36 s with 2 threads, 4.9 s with 1): compare at --threads 1 too, and read
`uptime` (printed before and after). Ray's node start has a fixed 30 s limit, which an overloaded machine can
miss; the relax side then reports nothing and the loop still runs (exit 1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from relax.config.env import threads_per_process

PHASES = ("generate", "ref", "train", "sync", "other")


# --------------------------------------------------------------------------- plain loop
def _lr_lambda(config, total_iters: int):
    """Linear warm-up then cosine decay to min_lr, as the preset asks (Megatron's schedule in shape; the exact
    value of the rate does not change the time of a step, which is what this benchmark measures)."""
    warm = int(config.lr_warmup_iters or 0)
    decay = int(getattr(config, "lr_decay_iters", None) or total_iters)
    floor = float(config.min_lr or 0.0) / float(config.lr)

    def f(it: int) -> float:
        if warm and it < warm:
            return (it + 1) / warm
        if config.lr_decay_style != "cosine":
            return 1.0
        frac = min(1.0, (it - warm) / max(1, decay - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


def _response_logprobs(model, seqs, attn, prompt_len: int, temperature: float, want_entropy: bool = False):
    """Log-probs (and entropy) of the response tokens under softmax(logits / T), [B, T_resp].

    Positions come from the attention mask, as `generate` used them for the left-padded prompts."""
    from relax import algorithms as alg

    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=seqs, attention_mask=attn, position_ids=pos).logits
    logits = logits[:, prompt_len - 1:-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.log_softmax(-1)
    lp = logp.gather(-1, seqs[:, prompt_len:].unsqueeze(-1)).squeeze(-1)
    return lp, (alg.entropy_from_logits(logits) if want_entropy else None)


def _batched_logprobs(model, seqs, attn, prompt_len, temperature, mbs):
    import torch

    with torch.no_grad():
        return torch.cat([_response_logprobs(model, seqs[i:i + mbs], attn[i:i + mbs], prompt_len, temperature)[0]
                          for i in range(0, len(seqs), mbs)])


def run_loop(config, steps: int, threads: int) -> list[dict]:
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax import algorithms as alg
    from relax.config.validate import import_hook
    from relax.models.embedded import build_embedded_assets
    from relax.rollout.prompts import encode_prompt
    from relax.rollout.rewards.builtin import exact_match_reward
    from relax.training.objective import PolicyObjective

    torch.set_num_threads(threads)
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    if config.meta.get("embedded_default"):
        build_embedded_assets(config.hf_checkpoint, config.prompt_data, seed=config.seed % 1000)
    # the run's reward: --custom-rm-path (e.g. the SmolLM2 example's number match), else the exact match
    custom_rm = import_hook(config.custom_rm_path, "--custom-rm-path") if config.custom_rm_path else None

    def reward(text: str, label: Any) -> float:
        if custom_rm is None:
            return exact_match_reward(text, label)
        return float(custom_rm(config, {"response_text": text, "label": label}))

    tok = AutoTokenizer.from_pretrained(config.hf_checkpoint)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(config.hf_checkpoint, torch_dtype=torch.float32)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if config.use_kl_loss else None
    records = [json.loads(x) for x in Path(config.prompt_data).read_text().splitlines() if x.strip()]

    objective = PolicyObjective.from_config(config)  # Relax's loss, not a copy of it
    n, k = config.rollout_batch_size, config.n_samples_per_prompt
    samples = n * k
    gbs = config.global_batch_size or samples
    num_updates = max(1, samples // gbs)
    mbs = config.micro_batch_size
    temperature = float(config.rollout_temperature)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                            eps=config.adam_eps, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(config, config.num_rollout * num_updates))
    eos, pad = tok.eos_token_id, tok.pad_token_id
    order: list[int] = []
    out = []
    for step in range(steps):
        t0 = time.perf_counter()
        # ---- other: pick and encode the step's prompts (an epoch-wise shuffle, like the data source)
        batch = []
        for _ in range(n):
            if not order:
                order = list(range(len(records)))
                rng.shuffle(order)
            batch.append(records[order.pop()])
        ids = [encode_prompt(r[config.input_key], tok, apply_chat_template=config.apply_chat_template)
               for r in batch]
        enc = tok.pad({"input_ids": ids}, return_tensors="pt")
        t1 = time.perf_counter()
        # ---- generate: all n*k answers in one batched call, then decode and score
        model.eval()
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                                 max_new_tokens=config.rollout_max_response_len, num_return_sequences=k,
                                 eos_token_id=eos, pad_token_id=pad)
        plen = enc["input_ids"].shape[1]
        resp = gen[:, plen:]
        # loss mask: response tokens up to and including the first stop token
        is_eos = resp == eos
        after = (is_eos.cumsum(-1) - is_eos.long()) > 0
        mask = (~after).float()
        if resp.shape[1] == 0:
            mask = mask[:, :0]
        attn = torch.cat([enc["attention_mask"].repeat_interleave(k, 0), mask.long()], dim=1)
        rewards = []
        for i in range(samples):
            toks = [t for t, m in zip(resp[i].tolist(), mask[i].tolist()) if m and t != eos]
            rewards.append(reward(tok.decode(toks), batch[i // k][config.label_key]))
        rewards_t = torch.tensor(rewards)
        t2 = time.perf_counter()
        # ---- ref: the frozen initial model's log-probs
        ref = _batched_logprobs(ref_model, gen, attn, plen, temperature, mbs) if ref_model is not None else None
        t3 = time.perf_counter()
        # ---- train: advantages, old log-probs (several updates per rollout), then the updates
        groups = torch.arange(samples) // k
        adv = alg.grpo_advantages(rewards_t, groups,
                                  normalize_std=not config.disable_grpo_std_normalization).float()
        adv_tok = adv[:, None].expand_as(mask) * mask
        model.eval()
        old = _batched_logprobs(model, gen, attn, plen, temperature, mbs) if num_updates > 1 else None
        model.train()
        perm = torch.randperm(samples) if config.rollout_shuffle else torch.arange(samples)
        stats = {"loss": [], "grad_norm": []}
        for u in range(num_updates):
            idx = perm[u * gbs:(u + 1) * gbs]
            step_tokens = mask[idx].sum().clamp_min(1)
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for j in range(0, len(idx), mbs):
                m = idx[j:j + mbs]
                lp, ent = _response_logprobs(model, gen[m], attn[m], plen, temperature, objective.needs_entropy)
                b = {"advantages": adv_tok[m], "loss_mask": mask[m]}
                if old is not None:
                    b["old_logprobs"] = old[m]
                if ref is not None:
                    b["ref_logprobs"] = ref[m]
                loss, _ = objective(lp, ent, b, mask[m])
                # Token-mean over the whole optimizer step whatever the split, as Relax weights micro-batches
                # (--calculate-per-token-loss); with the preset's one micro-batch per step the weight is 1.
                w = (mask[m].sum() / step_tokens) if config.calculate_per_token_loss else len(m) / len(idx)
                (loss * w).backward()
                total += float(loss.detach() * w)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad) if config.clip_grad \
                else torch.tensor(0.0)
            opt.step()
            sched.step()
            stats["loss"].append(total)
            stats["grad_norm"].append(float(gn))
        t4 = time.perf_counter()
        rec = {"step": step, "generate": t2 - t1, "ref": t3 - t2, "train": t4 - t3, "sync": 0.0,
               "step_time": t4 - t0, "reward": float(rewards_t.mean()), "resp_len": float(mask.sum(1).mean()),
               "loss": statistics.fmean(stats["loss"]), "grad_norm": statistics.fmean(stats["grad_norm"])}
        rec["other"] = rec["step_time"] - rec["generate"] - rec["ref"] - rec["train"]
        out.append(rec)
        print(f"  loop step {step}: {rec['step_time']:.2f} s (gen {rec['generate']:.2f}, ref {rec['ref']:.2f}, "
              f"train {rec['train']:.2f}) reward {rec['reward']:.3f} len {rec['resp_len']:.2f}", flush=True)
    return out


# --------------------------------------------------------------------------- relax-train
def run_relax(steps: int, out: Path, extra: list[str]) -> tuple[list[dict], float | None]:
    """Per-step phase times from metrics.jsonl, and launch to the start of the first step.

    Not benchmarks/e2e_bench.run: that waits for the process to end, and the launch time needs the moment the
    first metrics record appears (polled here); its parsing is one json.loads per line anyway."""
    cmd = [sys.executable, "-m", "relax.entrypoints.train", "--output-dir", str(out), "--num-rollout", str(steps),
           *extra]
    metrics = out / "metrics.jsonl"
    t_launch = time.perf_counter()
    first_at = None
    with open(out.parent / f"{out.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if first_at is None and metrics.is_file() and metrics.stat().st_size:
                first_at = time.perf_counter() - t_launch
            time.sleep(0.05)
    if proc.returncode != 0:  # e.g. Ray's node start timing out on an overloaded machine: the loop still runs
        print(f"relax-train failed ({proc.returncode}); log: {out.parent / (out.name + '.log')}\n"
              + (out.parent / f"{out.name}.log").read_text()[-2000:], file=sys.stderr)
        return [], None
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "perf/step_time" in r]
    recs = []
    for r in rows:
        rec = {"step": r["step"], "generate": r.get("perf/rollout_generate_time", r["perf/rollout_time"]),
               "ref": r.get("perf/ref_logprob_time", 0.0), "train": r.get("perf/train_compute_time", 0.0),
               "sync": r.get("perf/weight_sync_time", 0.0), "step_time": r["perf/step_time"],
               "reward": r.get("rollout/reward_mean", float("nan")),
               "resp_len": r.get("rollout/response_len_mean", float("nan")),
               # wall time the trainer actor spent in train() beyond its compute: Ray call + data plane fetch
               "train_wall": r.get("perf/train_time", 0.0), "rollout_wall": r["perf/rollout_time"]}
        rec["other"] = rec["step_time"] - rec["generate"] - rec["ref"] - rec["train"] - rec["sync"]
        recs.append(rec)
    # the first record is written when step 0 ends: its start is that moment minus its step time
    launch = first_at - recs[0]["step_time"] if first_at is not None and recs else None
    return recs, launch


# --------------------------------------------------------------------------- report
def _median(recs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in recs) if recs else float("nan")


def report(loop: list[dict], relax: list[dict], warmup: int, skipped: int | None = None) -> None:
    """`skipped`: the records were already cut to steps `skipped`.. of each run (several rounds)."""
    lo, rx = loop[warmup:] or loop, relax[warmup:] or relax
    first = warmup if skipped is None else skipped
    print(f"\nmedian seconds per step (steps {first}.. of each run; loop {len(lo)}, relax {len(rx)} measured)")
    print(f"{'phase':<10}{'loop':>10}{'relax':>10}{'relax/loop':>12}")
    for key in (*PHASES, "step_time"):
        a, b = _median(lo, key), _median(rx, key)
        ratio = b / a if a and a == a and b == b and a > 1e-9 else float("nan")
        name = "step" if key == "step_time" else key
        print(f"{name:<10}{a:>10.3f}{b:>10.3f}{ratio:>12.2f}")
    if rx:
        print(f"relax detail: rollout wall {_median(rx, 'rollout_wall'):.3f} s (generate "
              f"{_median(rx, 'generate'):.3f}), train wall {_median(rx, 'train_wall'):.3f} s (ref "
              f"{_median(rx, 'ref'):.3f} + compute {_median(rx, 'train'):.3f})")
    for name, recs in (("loop", lo), ("relax", rx)):
        if recs:
            print(f"{name}: reward {recs[0]['reward']:.3f} -> {recs[-1]['reward']:.3f}, "
                  f"response length {_median(recs, 'resp_len'):.2f} tokens")
    if lo and rx:
        print(f"relax/loop median step time ratio: {_median(rx, 'step_time') / _median(lo, 'step_time'):.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--skip-relax", action="store_true")
    p.add_argument("--skip-loop", action="store_true")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the loop (default: what a Relax trainer actor gets, "
                        "relax.config.env.threads_per_process)")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternate relax-train and the loop this many times; on a shared machine whose load drifts, "
                        "the median of the per-round ratios is the figure to read")
    p.add_argument("--keep", default=None, help="keep the run folders here (default: a temporary folder)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more relax-train flags (both sides)")
    args = p.parse_args()

    from relax.config import parse_config

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        relax, loop, ratios = [], [], []
        for rnd in range(args.rounds):
            print(f"{'' if args.rounds == 1 else f'round {rnd + 1} of {args.rounds}: '}"
                  f"uptime: {os.popen('uptime').read().strip()}")
            rx, lo = run_round(args, root / (f"round{rnd}" if args.rounds > 1 else "."), parse_config)
            # each round's own warm-up steps are left out; its ratio compares runs made minutes apart at most
            relax += rx[args.warmup:] or rx
            loop += lo[args.warmup:] or lo
            if rx and lo:
                ratios.append(_median(rx[args.warmup:] or rx, "step_time") / _median(lo[args.warmup:] or lo, "step_time"))
        print(f"uptime: {os.popen('uptime').read().strip()}")
        report(loop, relax, 0, args.warmup)
        if len(ratios) > 1:
            print(f"per-round ratios: {', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}")
    return 1 if not (relax or args.skip_relax) else 0


def run_round(args: argparse.Namespace, root: Path, parse_config) -> tuple[list[dict], list[dict]]:
    """One relax-train run, then the loop, both `args.steps` steps: per-step records of each."""
    root.mkdir(parents=True, exist_ok=True)
    relax, loop = [], []
    if not args.skip_relax:
        print(f"relax-train --num-rollout {args.steps} (log: {root / 'relax.log'}) ...", flush=True)
        relax, launch = run_relax(args.steps, root / "relax", args.extra)
        for r in relax:
            print(f"  relax step {r['step']}: {r['step_time']:.2f} s (gen {r['generate']:.2f}, ref "
                  f"{r['ref']:.2f}, train {r['train']:.2f}, sync {r['sync']:.3f}) reward {r['reward']:.3f}")
        print(f"relax launch to first step: {launch:.1f} s" if launch is not None else "launch: unknown")
    if not args.skip_loop:
        # --num-rollout as relax-train's run has it: a run with its own --prompt-data needs it to parse
        config = parse_config(["--output-dir", str(root / "loop"), "--num-rollout", str(args.steps), *args.extra])
        # A Relax trainer actor's torch threads (relax/core/controller.py).
        world = config.resource["actor"][0] * config.resource["actor"][1]
        threads = args.threads or threads_per_process(world)
        print(f"plain loop: {threads} torch threads, {config.rollout_batch_size} prompts x "
              f"{config.n_samples_per_prompt}, {config.rollout_max_response_len} new tokens, "
              f"{config.num_steps_per_rollout} updates of {config.global_batch_size} in micro-batches of "
              f"{config.micro_batch_size}, kl {config.kl_loss_type} {config.kl_loss_coef}", flush=True)
        loop = run_loop(config, args.steps, threads)
    return relax, loop

if __name__ == "__main__":
    raise SystemExit(main())
