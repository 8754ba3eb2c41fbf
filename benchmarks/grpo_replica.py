"""A single-process replica of the embedded default's GRPO, for seed sweeps in minutes instead of hours.

    .venv/bin/python benchmarks/grpo_replica.py                          # 8 seeds x 100 steps, the preset
    .venv/bin/python benchmarks/grpo_replica.py --seeds 1234 --kl 0.01 --dual-clip 0 --steps 60
    .venv/bin/python benchmarks/grpo_replica.py --entropy-coef 0 --eps-clip-high 0.28
    .venv/bin/python benchmarks/grpo_replica.py --seeds 1234 --steps 40 --lora-rank 16            # LoRA: plateau ~0.3
    .venv/bin/python benchmarks/grpo_replica.py --seeds 1234 --steps 40 --lora-rank 16 --train-head
    .venv/bin/python benchmarks/grpo_replica.py --seeds 1234,4321,777,5555 --head-cap   # why: the frozen head's cap

It is not `relax-train` (no Ray, no engine, no Megatron; its own sampling RNG, so a seed's trajectory differs
from the real run's), but it computes the same objective on the same assets: the embedded model and task
(`relax.models.embedded.build_embedded_assets`, through the user cache), 32 prompts x 16 samples per step
drawn from the shuffled 100-row task file, temperature sampling of at most 8 tokens, exact match, GRPO
advantages ((r - group mean) / (unbiased group std + 1e-6)), old log-probs = the policy at rollout time, PPO
clip 0.2 with optional dual clip, low_var_kl to the warm start, the per-token mean over each optimizer step's
128 samples, Adam (0.9, 0.999, 1e-8) with clip-grad 1.0, linear warm-up from 0 and cosine decay over
--schedule-steps rollouts, the entropy bonus. Defaults are the embedded preset's (relax/config/presets.py).
What trains: everything (the default), --train body (the layers' linears and biases: embeddings, LM head and norms
frozen), or --lora-rank R (a minimal LoRA as relax.backends.megatron.lora's: one kaiming A per fused Megatron
linear, zero B, alpha / r; biases frozen), each optionally with --train-head / --train-norms / --train-embed /
--train-biases. Use it to compare settings across many seeds; confirm a choice with benchmarks/seed_sweep.py (the
real job).

Prints per seed the first step whose 5-step mean reward exceeds 0.8 and the final reward, then the spread.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEEDS = (1234, 4321, 777, 5555, 1, 2, 3, 42)


def _lora_group(target: str) -> tuple[str, list[str]]:
    """(parent module, HF modules) a Megatron fused linear covers in the embedded qwen2 model, by Relax's own naming
    rule (relax.formats.hf_names): one A per fused linear, as Relax's."""
    from relax.formats.hf_names import LORA_TARGET_SUFFIX, layer_hf_names

    _, names = layer_hf_names(0, LORA_TARGET_SUFFIX[target] + ".weight")  # model.layers.0.<parent>.<module>.weight
    return names[0].split(".")[3], [n.split(".")[4] for n in names]


_NORM_NAMES = ("input_layernorm", "post_attention_layernorm", "model.norm")


def _add_lora(a, model, seed: int) -> list:
    """A minimal LoRA as relax.backends.megatron.lora's: per fused Megatron linear one A [r, in] (kaiming-uniform,
    U(-1/sqrt(in), 1/sqrt(in))) shared by the HF modules it covers, a zero B per module, output += alpha/r B(A x).
    Biases stay frozen."""
    import torch
    import torch.nn.functional as F

    r, scale = a.lora_rank, a.lora_alpha / a.lora_rank
    gen = torch.Generator().manual_seed(seed + 17)
    params = []
    for li, layer in enumerate(model.model.layers):
        for target in a.lora_targets.split(","):
            parent_name, names = _lora_group(target)
            parent = getattr(layer, parent_name)
            mods = [getattr(parent, n) for n in names]
            fan_in = mods[0].in_features
            bound = 1.0 / math.sqrt(fan_in)
            if a.lora_init == "gaussian":
                A = torch.nn.Parameter(torch.empty(r, fan_in).normal_(0.0, 1.0 / r, generator=gen))
            else:
                A = torch.nn.Parameter(torch.empty(r, fan_in).uniform_(-bound, bound, generator=gen))
            params.append(A)
            for name, mod in zip(names, mods):
                B = torch.nn.Parameter(torch.zeros(mod.out_features, r))
                mod._lora = (A, B)
                params.append(B)

                def hook(m, args, out):
                    A_, B_ = m._lora
                    return out + F.linear(F.linear(args[0], A_), B_) * scale

                mod.register_forward_hook(hook)
    return params


def configure_trainable(a, model, seed: int) -> list:
    """What trains (--train / --lora-rank and the --train-* additions); returns the optimizer's parameters."""
    base = dict(model.named_parameters())
    for p in base.values():
        p.requires_grad_(False)
    chosen = []
    if a.lora_rank:
        chosen += _add_lora(a, model, seed)
    elif a.train == "all":
        chosen += list(base.values())
    elif a.train == "body":  # full fine-tuning of the transformer layers' linears (+ biases), no embeddings/head/norms
        chosen += [p for n, p in base.items() if n.startswith("model.layers.") and "layernorm" not in n]
    elif a.train == "none":
        pass
    extra = []
    if a.train_norms:
        extra += [p for n, p in base.items() if any(k in n for k in _NORM_NAMES)]
    if a.train_embed:
        extra += [p for n, p in base.items() if "embed_tokens" in n]
    if a.train_head:
        extra += [p for n, p in base.items() if n.startswith("lm_head")]
    if a.train_biases:
        extra += [p for n, p in base.items() if n.endswith(".bias")]
    seen = {id(p) for p in chosen}
    chosen += [p for p in extra if id(p) not in seen and not seen.add(id(p))]
    for p in chosen:
        p.requires_grad_(True)
    return chosen


def head_cap(seed: int, workdir: Path, steps: int = 3000) -> dict:
    """The most any change of the transformer body (LoRA on any linears at any rank, or full fine-tuning of the
    layers) can reach with the final norm and the LM head frozen: for each digit d, the final hidden state x itself
    (64 free numbers) is optimised through the frozen final RMSNorm and LM head for log p(d). A body change only
    moves x, so max p(d) bounds the reward of every prompt whose answer is d."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.models.embedded import build_embedded_assets

    base = workdir / f"assets_{seed % 1000}"
    build_embedded_assets(str(base / "model"), str(base / "train.jsonl"), seed=seed % 1000)
    tok = AutoTokenizer.from_pretrained(base / "model")
    model = AutoModelForCausalLM.from_pretrained(base / "model", dtype=torch.float32)
    model.requires_grad_(False)
    digits = torch.tensor([tok.convert_tokens_to_ids(tok.tokenize(str(d)))[0] for d in range(10)])
    x = torch.randn(10, model.config.hidden_size, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    opt = torch.optim.Adam([x], lr=0.05)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model.lm_head(model.model.norm(x)), digits)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        cap = torch.softmax(model.lm_head(model.model.norm(x)), -1)[torch.arange(10), digits]
        rows = model.lm_head.weight[digits] * model.model.norm.weight
        cos = torch.nn.functional.cosine_similarity(rows[:, None], rows[None], dim=-1)
    return {"seed": seed, "cap": cap.tolist(), "cap_mean": float(cap.mean()),
            "digit_rows_mean_cos": float((cos.sum() - 10) / 90)}


def run_seed(a, seed: int, workdir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.models.embedded import build_embedded_assets
    from relax.models.tasks import render_prompt

    base = workdir / f"assets_{seed % 1000}"
    build_embedded_assets(str(base / "model"), str(base / "train.jsonl"), seed=seed % 1000)  # as the controller
    tok = AutoTokenizer.from_pretrained(base / "model")
    model = AutoModelForCausalLM.from_pretrained(base / "model", dtype=torch.float32)
    ref = copy.deepcopy(model).eval()
    params = configure_trainable(a, model, seed)
    rows = [json.loads(line) for line in (base / "train.jsonl").read_text().splitlines()]
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.Adam(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay)
    total = a.schedule_steps * a.steps_per_rollout

    def lr_at(i: int) -> float:
        if i < a.warmup_iters:
            return a.lr * i / a.warmup_iters
        frac = min(1.0, (i - a.warmup_iters) / max(1, total - a.warmup_iters))
        return a.min_lr + (a.lr - a.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))

    order, pos, it, rewards = list(range(len(rows))), len(rows), 0, []
    for step in range(a.steps):
        batch = []
        for _ in range(a.prompts):
            if pos >= len(order):
                rng.shuffle(order)
                pos = 0
            batch.append(rows[order[pos]])
            pos += 1
        prompts = [tok(render_prompt(tok, r["input"]), add_special_tokens=False)["input_ids"] for r in batch]
        plen = len(prompts[0])
        assert all(len(x) == plen for x in prompts), "the tiny tasks' prompts all have one length"
        ids = torch.tensor([x for x in prompts for _ in range(a.n)])
        n_all = ids.shape[0]
        done = torch.zeros(n_all, dtype=torch.bool)
        out_tokens = []
        model.eval()
        with torch.no_grad():
            cur = ids
            for _ in range(8):
                logits = model(input_ids=cur).logits[:, -1].float() / a.temperature
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(1)
                nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
                out_tokens.append(nxt)
                done |= nxt == eos
                cur = torch.cat([cur, nxt[:, None]], 1)
                if bool(done.all()):
                    break
        resp = torch.stack(out_tokens, 1)
        width = resp.shape[1]
        mask = torch.zeros(n_all, width)
        for b in range(n_all):
            for t in range(width):
                mask[b, t] = 1
                if resp[b, t] == eos:
                    break
        labels = [r["label"] for r in batch for _ in range(a.n)]
        reward = torch.tensor([
            1.0 if tok.decode([int(x) for x, m in zip(resp[b], mask[b]) if m and int(x) != eos]).strip() == labels[b]
            else 0.0 for b in range(n_all)]).view(a.prompts, a.n)
        adv = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)).view(-1)
        full = torch.cat([ids, torch.where(mask.bool(), resp, torch.full_like(resp, pad))], 1)
        attn = torch.cat([torch.ones(n_all, plen), mask], 1).long()

        def logp(m, idx, with_entropy=False):
            lg = m(input_ids=full[idx], attention_mask=attn[idx]).logits.float()[:, plen - 1:plen - 1 + width]
            lp = torch.log_softmax(lg / a.temperature, -1)
            picked = lp.gather(-1, resp[idx].clamp(min=0)[..., None]).squeeze(-1)
            return (picked, -(lp.exp() * lp).sum(-1)) if with_entropy else picked

        with torch.no_grad():
            old, ref_lp = logp(model, torch.arange(n_all)), logp(ref, torch.arange(n_all))
        model.train()
        per = n_all // a.steps_per_rollout
        for k in range(a.steps_per_rollout):
            idx = torch.arange(k * per, (k + 1) * per)
            for group in opt.param_groups:
                group["lr"] = lr_at(it)
            opt.zero_grad()
            (lp, ent), m, adv_k = logp(model, idx, with_entropy=True), mask[idx], adv[idx][:, None]
            ratio = torch.exp(lp - old[idx])
            high = a.eps_clip_high if a.eps_clip_high is not None else a.eps_clip
            pg = torch.maximum(-adv_k * ratio, -adv_k * ratio.clamp(1 - a.eps_clip, 1 + high))
            if a.dual_clip:
                pg = torch.where(adv_k < 0, torch.minimum(pg, -a.dual_clip * adv_k), pg)
            x = (lp - ref_lp[idx]).clamp(-20, 20)
            kl = (torch.expm1(-x) + x).clamp(-10, 10)
            (((pg + a.kl * kl - a.entropy_coef * ent) * m).sum() / m.sum()).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            it += 1
        rewards.append(float(reward.mean()))
        if a.log_every and step % a.log_every == 0:
            print(f"  seed {seed} step {step}: reward {rewards[-1]:.3f}", flush=True)
    cross = next((i for i in range(4, len(rewards)) if statistics.fmean(rewards[i - 4:i + 1]) > 0.8), None)
    return {"seed": seed, "cross": cross, "final": rewards[-1], "final5": statistics.fmean(rewards[-5:]),
            "rewards": rewards}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--schedule-steps", type=int, default=100, help="the run length the lr schedule is for")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr", type=float, default=2e-4)
    p.add_argument("--warmup-iters", type=int, default=20)
    p.add_argument("--steps-per-rollout", type=int, default=4)
    p.add_argument("--kl", type=float, default=0.1)
    p.add_argument("--eps-clip", type=float, default=0.2)
    p.add_argument("--eps-clip-high", type=float, default=None, help="default: --eps-clip")
    p.add_argument("--entropy-coef", type=float, default=0.01)
    p.add_argument("--dual-clip", type=float, default=3.0, help="0: off")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--train", choices=("all", "body", "none"), default="all",
                   help="full fine-tuning of everything, of the layers' linears only (embeddings, LM head and norms "
                        "frozen), or of nothing but the --train-* additions; ignored with --lora-rank")
    p.add_argument("--lora-rank", type=int, default=0, help="> 0: LoRA adapters instead of --train (base frozen)")
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-init", choices=("kaiming", "gaussian"), default="kaiming")
    p.add_argument("--lora-targets", default="linear_qkv,linear_proj,linear_fc1,linear_fc2")
    p.add_argument("--train-norms", action="store_true", help="also train the RMSNorm weights")
    p.add_argument("--train-embed", action="store_true", help="also train the input embeddings")
    p.add_argument("--train-head", action="store_true", help="also train the LM head (untied)")
    p.add_argument("--train-biases", action="store_true", help="also train the biases (qwen2's QKV)")
    p.add_argument("--head-cap", action="store_true",
                   help="only print, per seed, the highest p(answer digit) any change of the body can reach with "
                        "the final norm and LM head frozen (what LoRA without --train-head can reach)")
    p.add_argument("--log-every", type=int, default=0, help="print the reward every this many steps (0: off)")
    p.add_argument("--json", default=None, help="write the per-seed results (rewards included) here")
    p.add_argument("--workdir", default=None, help="where the assets are copied (default: a temporary folder)")
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(a.workdir or tmp)
        if a.head_cap:
            for seed in (int(s) for s in a.seeds.split(",")):
                r = head_cap(seed, workdir)
                print(f"seed {seed}: max p(digit) with the head frozen {r['cap_mean']:.3f} (per digit "
                      f"{min(r['cap']):.2f}-{max(r['cap']):.2f}); digit rows of the head (x norm gain): mean "
                      f"pairwise cosine {r['digit_rows_mean_cos']:.3f}", flush=True)
            return 0
        for seed in (int(s) for s in a.seeds.split(",")):
            t0 = time.perf_counter()
            r = run_seed(a, seed, workdir)
            results.append(r)
            print(f"seed {seed}: 5-step mean > 0.8 at step {r['cross']}, final {r['final']:.3f} "
                  f"(mean of last 5 {r['final5']:.3f}), {time.perf_counter() - t0:.0f} s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}))
    crossings = [r["cross"] if r["cross"] is not None else a.steps for r in results]
    print(f"crossing over {len(results)} seeds: min {min(crossings)}, median {statistics.median(crossings):g}, "
          f"max {max(crossings)}; final reward min {min(r['final'] for r in results):.3f}")
    return 0 if all(r["cross"] is not None for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
