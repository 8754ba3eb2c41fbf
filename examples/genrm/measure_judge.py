"""SmolLM2-135M-Instruct as a generative reward model (GenRM) on the word-problem task, on CPU: how fast it judges
and how often its verdict agrees with the exact (last-number) reward on the same samples.

    .venv/bin/python examples/genrm/measure_judge.py --model runs/smollm2/model [--prompts 32 --n 2]

One embedded engine serves the model (the same server a run's GenRM engines use). The policy answers come from
the same model (the samples a run with `--hf-checkpoint` = `--genrm-model-path` would judge at step 0); each
answer is judged by `relax.rollout.rewards.genrm.GenRMJudge` exactly as a run does (the default judge template
through the model's chat template, the default `\\boxed{}` parser, --genrm-sampling-config's defaults except the
reply length), and scored by `relax.models.tasks.number_match_reward` (the example's exact reward).

Printed (and written to --out as JSON): judgments/s and judge tokens/s at --concurrency requests in flight, mean
latency, parse failures (verdicts without a readable score: a run applies --reward-error-policy to them), and on
the parsed verdicts the agreement with the exact reward (verdict >= 0.5 read as "correct"): rate, confusion
counts and Cohen's kappa (agreement beyond what the two positive rates give by chance).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]  # relax, and judge_hooks for --template/--parser

from relax.backends.embedded.launcher import EmbeddedServerProcess  # noqa: E402
from relax.rollout.generate import engine_reply, generate_payload, post_generate  # noqa: E402
from relax.config.genrm_options import DEFAULT_SAMPLING  # noqa: E402
from relax.rollout.rewards.genrm import (GenRMJudge, GenRMParseError, default_parser,  # noqa: E402
                                         default_template, load_genrm_hook)
from relax.models.tasks import number_match_reward, render_prompt, task_rows  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face folder (scripts/convert_smollm2.py writes one)")
    p.add_argument("--prompts", type=int, default=32, help="word problems (the task's generated prompts)")
    p.add_argument("--n", type=int, default=2, help="policy answers per problem")
    p.add_argument("--seed", type=int, default=0, help="which problems (task_rows' seed) and the engine's seed")
    p.add_argument("--answer-len", type=int, default=48, help="policy answer tokens at most")
    p.add_argument("--judge-len", type=int, default=128,
                   help="judge reply tokens at most (--genrm-sampling-config's max_response_len; its default "
                        f"{DEFAULT_SAMPLING['max_response_len']} is far beyond what this judge writes)")
    p.add_argument("--concurrency", type=int, default=16, help="judge requests in flight")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="engine torch threads")
    p.add_argument("--template", default=None, help="judge template by dotted path (--genrm-template-path)")
    p.add_argument("--parser", default=None, help="verdict parser by dotted path (--genrm-parser-path)")
    p.add_argument("--out", default=None, help="also write the figures (and every verdict) here as JSON")
    return p.parse_args(argv)


async def policy_answers(url: str, tokenizer: Any, rows: list[dict], n: int, max_len: int) -> list[dict]:
    """`n` sampled answers (temperature 1) per problem, as the samples a run would judge."""
    async with aiohttp.ClientSession() as session:
        async def one(i: int, row: dict) -> list[dict]:
            ids = tokenizer.encode(render_prompt(tokenizer, row["input"]), add_special_tokens=False)
            params = {"max_new_tokens": max_len, "temperature": 1.0, "n": n, "sampling_seed": 1000 * i}
            body = await post_generate(session, url, generate_payload(ids, params), timeout_s=600, retries=1,
                                       what=f"problem {i}")
            return [{"prompt": row["input"], "label": row["label"], "response_text": engine_reply(b).text,
                     "metadata": {}} for b in (body if isinstance(body, list) else [body])]
        groups = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    return [s for g in groups for s in g]


async def judge_all(judge: GenRMJudge, samples: list[dict], concurrency: int) -> tuple[list[Any], float]:
    """Each sample's verdict score (None: unparseable) and the wall time of all the judgments."""
    limit = asyncio.Semaphore(concurrency)

    async def one(sample: dict) -> Any:
        async with limit:
            try:
                return await judge.ajudge(sample)
            except GenRMParseError:
                return None

    t0 = time.perf_counter()
    scores = await asyncio.gather(*(one(s) for s in samples))
    return list(scores), time.perf_counter() - t0


def agreement(verdicts: list[float], exact: list[float]) -> dict[str, float]:
    """Agreement of verdicts (>= 0.5: correct) with the exact reward, and Cohen's kappa."""
    pairs = [(v >= 0.5, e >= 0.5) for v, e in zip(verdicts, exact)]
    total = len(pairs)
    if not total:
        return {"parsed": 0}
    both = sum(j and e for j, e in pairs)
    neither = sum(not j and not e for j, e in pairs)
    judge_only = sum(j and not e for j, e in pairs)
    exact_only = sum(e and not j for j, e in pairs)
    observed = (both + neither) / total
    pj, pe = (both + judge_only) / total, (both + exact_only) / total
    chance = pj * pe + (1 - pj) * (1 - pe)
    kappa = (observed - chance) / (1 - chance) if chance < 1 else float("nan")
    return {"parsed": total, "agreement": round(observed, 4), "cohen_kappa": round(kappa, 4),
            "judge_positive_rate": round(pj, 4), "exact_positive_rate": round(pe, 4), "both_correct": both, "both_wrong": neither,
            "judge_says_correct_exact_wrong": judge_only, "judge_says_wrong_exact_correct": exact_only}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = task_rows(args.prompts, args.seed, task="word_arith")
    engine = EmbeddedServerProcess(args.model, server_args={
        "random_seed": args.seed, "dtype": "float32", "num_threads": args.threads,
        "max_running_requests": max(args.concurrency, args.n * args.prompts)})
    engine.start()
    try:
        engine.wait_healthy(timeout_s=300)
        t0 = time.perf_counter()
        samples = asyncio.run(policy_answers(engine.url, tokenizer, rows, args.n, args.answer_len))
        answer_s = time.perf_counter() - t0
        judge = GenRMJudge(engine.url, tokenizer, sampling={"max_response_len": args.judge_len},
                           template=load_genrm_hook(args.template, "--template", default_template),
                           parser=load_genrm_hook(args.parser, "--parser", default_parser))
        scores, judge_s = asyncio.run(judge_all(judge, samples, args.concurrency))
        latency = judge.take_metrics()
    finally:
        engine.stop()
    exact = [number_match_reward(s["response_text"], s["label"]) for s in samples]
    parsed = [(v, e) for v, e in zip(scores, exact) if v is not None]
    verdict_tokens = sum(len(tokenizer.encode(s["metadata"].get("genrm_verdict", ""), add_special_tokens=False))
                         for s in samples)
    figures = {
        "model": args.model, "samples": len(samples), "concurrency": args.concurrency, "threads": args.threads,
        "judge_len": args.judge_len, "template": args.template or "default", "parser": args.parser or "default", "policy_answer_seconds": round(answer_s, 2),
        "judge_seconds": round(judge_s, 2), "judgments_per_s": round(len(samples) / judge_s, 3),
        "judge_tokens_per_s": round(verdict_tokens / judge_s, 1),
        "judge_latency_mean_s": round(latency.get("genrm/latency_mean", float("nan")), 3),
        "parse_failures": sum(v is None for v in scores),
        "exact_positive_rate_all": sum(exact) / len(exact) if exact else float("nan"),
        **agreement([v for v, _ in parsed], [e for _, e in parsed]),
    }
    print(json.dumps(figures, indent=2))
    if args.out:
        verdicts = [{"label": s["label"], "response": s["response_text"], "exact": e, "verdict_score": v,
                     "verdict": s["metadata"].get("genrm_verdict")} for s, v, e in zip(samples, scores, exact)]
        Path(args.out).write_text(json.dumps({"figures": figures, "verdicts": verdicts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
