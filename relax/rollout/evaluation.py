"""Evaluation sets and `evaluate`: metrics under `eval/<name>/...`.

The sets (`--eval-prompt-data`, `--eval-config`, their keys and fallbacks) are read and
checked by `relax.config.eval_sets` (names re-exported here).

Generation: each sample goes through the default token-in/token-out call (or
`--custom-generate-function-path`), as in the default rollout function. `--eval-function-path` replaces
this for evaluation only: `fn(ctx, rollout_id, eval_set, groups) -> groups` (sync or async) receives
the set's prompt groups (`list[list[Sample]]`, `eval_set.n_samples_per_eval_prompt` each, responses
empty; `eval_set.sampling_params()` gives the set's sampling) and returns them generated; `ctx` is the
`RolloutContext` with a live session (`await ctx.engine_generate(...)`). Scoring and metrics stay
Relax's.

Metrics per set: `reward_mean`, `reward_std`, `response_len_mean`, `truncated_fraction`,
`num_samples`, `reward_errors`, `filtered_long_prompts`, and with `--log-passrate` `pass@k` for k =
1, 2, 4, ... up to the samples per prompt (unbiased estimator; a sample passes when its reward > 0).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import statistics
from typing import Any, Sequence

import aiohttp

# The sets themselves are read and checked with the config; their names stay importable from here.
from relax.config.eval_sets import EVAL_SET_KEYS, EvalSet, eval_sets, load_eval_config, reader_keys  # noqa: F401
from relax.formats.prompt_files import read_prompt_records
from relax.data.sample import STATUS_TRUNCATED, Sample
from relax.rollout.context import load_hook
from relax.rollout.multimodal import SAMPLE_KEY as MULTIMODAL
from relax.rollout.rewards import RewardRunner
from relax.rollout.sglang_rollout import generate_sample


# --------------------------------------------------------------------------- pass@k

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with n samples of which c passed (Chen et al., 2021)."""
    if k > n:
        raise ValueError(f"k={k} > n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def passrate_metrics(groups: Sequence[Sequence[Any]], prefix: str) -> dict[str, float]:
    """`{prefix}pass@k` averaged over prompt groups for k = 1, 2, 4, ... <= group size."""
    if not groups:
        return {}
    n = min(len(g) for g in groups)
    out = {}
    k = 1
    while k <= n:
        out[f"{prefix}pass@{k}"] = statistics.fmean(
            pass_at_k(len(g), sum(float(s.reward) > 0 for s in g), k) for g in groups)
        k *= 2
    return out


# --------------------------------------------------------------------------- running

def _records(es: EvalSet, args: Any):
    return read_prompt_records(es.path, **reader_keys(es), skip_bad_lines=bool(args.skip_bad_lines),
                               multimodal_keys=args.multimodal_keys)[0]


async def aevaluate_set(ctx: Any, es: EvalSet, encoder: Any, rollout_id: int) -> tuple[dict, list]:
    """Generate and score one set; returns (metrics without prefix, groups)."""
    args = ctx.args
    custom = load_hook(args.custom_generate_function_path, "--custom-generate-function-path")
    sampling = es.sampling_params(bool(args.rollout_skip_special_tokens))
    groups, filtered = [], 0
    for rec in _records(es, args):
        tokens = encoder.encode(rec)
        if es.max_prompt_len is not None and len(tokens) > es.max_prompt_len:
            filtered += 1
            continue
        groups.append([Sample(index=len(groups) * es.n_samples_per_eval_prompt + j, group_index=len(groups),
                              prompt=rec.prompt, prompt_tokens=list(tokens), label=rec.label,
                              metadata={**rec.metadata, "eval_set": es.name, "prompt_index": rec.index,
                                        **({MULTIMODAL: rec.multimodal} if rec.multimodal else {})},
                              rollout_step=rollout_id)
                       for j in range(es.n_samples_per_eval_prompt)])
    limit = asyncio.Semaphore(ctx.max_concurrency)

    async def one(s):
        async with limit:
            return await generate_sample(ctx, s, sampling, custom, max_context_len=es.max_context_len)

    eval_fn = load_hook(args.eval_function_path, "--eval-function-path")
    runner = RewardRunner.from_args(args, rm_type=es.rm_type, custom_rm_path=es.custom_rm_path,
                                    reward_key=es.reward_key)
    try:
        async with aiohttp.ClientSession() as session:
            ctx.session = session
            try:
                if eval_fn is not None:
                    groups = await run_eval_function(eval_fn, ctx, rollout_id, es, groups)
                    flat = [s for g in groups for s in g]
                else:
                    flat = await asyncio.gather(*(one(s) for g in groups for s in g))
            finally:
                ctx.session = None
        if eval_fn is None:
            n = es.n_samples_per_eval_prompt
            groups = [list(flat[i:i + n]) for i in range(0, len(flat), n)]
        result = await runner.ascore(groups, assign=True) if groups else None
    finally:
        runner.close()
    rewards = [float(s.reward) for s in flat]
    lengths = [len(s.response_tokens) for s in flat]
    metrics = {
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if rewards else 0.0,
        "response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "truncated_fraction": (sum(s.status == STATUS_TRUNCATED for s in flat) / len(flat)) if flat else 0.0,
        "num_samples": float(len(flat)),
        "reward_errors": float(result.num_errors if result else 0),
        "filtered_long_prompts": float(filtered),
    }
    if args.log_passrate:
        metrics.update(passrate_metrics(groups, ""))
    return metrics, groups


async def run_eval_function(fn: Any, ctx: Any, rollout_id: int, es: EvalSet, groups: list) -> list:
    """Call an `--eval-function-path` function (sync or async) and check its answer."""
    out = fn(ctx, rollout_id, es, groups)
    if inspect.isawaitable(out):
        out = await out
    out = groups if out is None else [g if isinstance(g, list) else [g] for g in out]
    for g in out:
        if not g or not all(isinstance(s, Sample) for s in g):
            raise TypeError(f"--eval-function-path: must return non-empty lists of Sample (eval set {es.name!r})")
        for s in g:
            s.validate()
    return out


def evaluate(ctx: Any, encoder: Any, rollout_id: int, sets: Sequence[EvalSet]) -> tuple[dict, dict]:
    """All sets: (`eval/<name>/<metric>` dict, {name: groups})."""
    metrics, data = {}, {}
    for es in sets:
        m, groups = asyncio.run(aevaluate_set(ctx, es, encoder, rollout_id))
        metrics.update({f"eval/{es.name}/{k}": v for k, v in m.items()})
        data[es.name] = groups
    return metrics, data
