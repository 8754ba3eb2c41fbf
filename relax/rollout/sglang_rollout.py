"""The default rollout function (`--rollout-function-path`): over-sampling, dynamic filtering, partial rollout.

`generate_rollout(ctx, rollout_id)` returns exactly `--rollout-batch-size` prompt groups:

* Prompt groups come from the data source (`get_samples`), `--over-sampling-batch-size` at a time;
  whenever the kept groups plus the groups in flight fall below the target, another batch is requested.
* Each group is generated (the default token-in/token-out call, or `--custom-generate-function-path`
  per sample) and scored as soon as it finishes; `--dynamic-sampling-filter-path` then keeps or drops it
  (`fn(args, group) -> bool`, or `(bool, reason)`, or an object with `.keep` / `.reason`).
* Once the target is reached, the groups still in flight are aborted at the engines. Without
  `--partial-rollout` they go back to the data source (`add_samples`) as prompts, to be generated again
  with newer weights; with it they go back with their partial responses and resume later
  (`--partial-rollout-max-aborted-count` N: a sample aborted N times is no longer aborted but run to
  completion). Completed groups beyond the target go back the same way.

Metrics say what happened: `rollout/filtered_groups` (and `rollout/filtered_groups/<reason>`),
`rollout/returned_groups`, `rollout/aborted_samples`, `rollout/generated_groups`,
`rollout/sampling_rounds`, `rollout/reward_errors`, and the same in samples as the step's sample accounting
(`samples/*`, see `relax.observability.accounting`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Callable, Optional

import aiohttp

from relax.data.sample import STATUS_ABORTED, Sample
from relax.observability.accounting import rollout_accounting
from relax.rollout.buffer import is_generated, reset_group
from relax.rollout.context import RolloutContext, RolloutOutput, load_hook
from relax.rollout.generate import SamplingSettings, generate_group, generate_one, group_request_ok

logger = logging.getLogger(__name__)

MAX_GROUPS_FACTOR = 64  # a step gives up after generating this many times --rollout-batch-size groups


def filter_verdict(fn: Callable, args: Any, group: list[Sample]) -> tuple[bool, str]:
    """Normalize a dynamic-sampling filter's answer to (keep, reason)."""
    out = fn(args, group)
    reason = getattr(fn, "__name__", "filter")
    if isinstance(out, tuple):
        keep = bool(out[0])
        reason = str(out[1]) if len(out) > 1 and out[1] else reason
    elif hasattr(out, "keep"):
        keep = bool(out.keep)
        reason = str(getattr(out, "reason", None) or reason)
    else:
        keep = bool(out)
    return keep, reason


async def generate_sample(ctx: RolloutContext, sample: Sample, sampling: dict, custom: Optional[Callable] = None,
                          max_context_len: Optional[int] = None) -> Sample:
    """One sample through the custom generate function or the default single call."""
    args = ctx.args
    if custom is not None:
        out = await custom(ctx, sample, dict(sampling))
        sample = out if isinstance(out, Sample) else sample
        if not sample.loss_mask:
            sample.loss_mask = [1] * len(sample.response_tokens)
        sample.validate()
        if len(sample.response_logprobs) != len(sample.response_tokens):
            raise ValueError(f"--custom-generate-function-path: {sample.describe()} has "
                             f"{len(sample.response_logprobs)} log-probs for {len(sample.response_tokens)} tokens "
                             "(give 0.0 for tool/environment tokens)")
        return sample
    return await generate_one(ctx.session, ctx.router_url, sample, sampling, timeout_s=ctx.timeout_s,
                              retries=ctx.retries,
                              mask_offpolicy=bool(args.mask_offpolicy_in_partial_rollout),
                              max_context_len=max_context_len,
                              return_routed_experts=bool(args.use_rollout_routing_replay))


def generate_rollout(ctx: RolloutContext, rollout_id: int) -> RolloutOutput:
    return asyncio.run(agenerate_rollout(ctx, rollout_id))


async def agenerate_rollout(ctx: RolloutContext, rollout_id: int) -> RolloutOutput:
    args = ctx.args
    target = int(args.rollout_batch_size)
    over = int(args.over_sampling_batch_size or target)
    partial = bool(args.partial_rollout)
    max_aborts = args.partial_rollout_max_aborted_count
    dyn_filter = load_hook(args.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path")
    custom = load_hook(args.custom_generate_function_path, "--custom-generate-function-path")
    sampling = SamplingSettings.from_config(args).to_sglang()
    limit = asyncio.Semaphore(ctx.max_concurrency)
    counts: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()  # filtered groups by reason
    filtered_samples: collections.Counter = collections.Counter()

    stopping = asyncio.Event()

    def exempt(sample: Sample) -> bool:  # run to completion even when the step stops
        return partial and max_aborts is not None and sample.metadata.get("aborted_count", 0) >= max_aborts

    async def run_sample(sample: Sample) -> Sample:
        if is_generated(sample):
            return sample
        async with limit:
            if stopping.is_set() and not exempt(sample):
                sample.status = STATUS_ABORTED  # never started (or resumed): nothing to abort at the engine
                return sample
            out = await generate_sample(ctx, sample, sampling, custom)
        if ctx.progress is not None:
            ctx.progress.update(1)
        return out

    # A fresh group of one prompt is one request (SGLang's `n`) where the engines support it; a group request
    # holds as many permits of the concurrency budget as it has samples, through its own semaphore.
    by_group = (ctx.group_requests and custom is None
                and not args.use_rollout_routing_replay)
    group_limit = asyncio.Semaphore(max(1, ctx.max_concurrency // max(1, int(args.n_samples_per_prompt))))

    async def run_fresh_group(group: list[Sample]) -> list[Sample]:
        async with group_limit:
            if stopping.is_set():
                for s in group:
                    s.status = STATUS_ABORTED
                return group
            out = await generate_group(ctx.session, ctx.router_url, group, sampling, timeout_s=ctx.timeout_s,
                                       retries=ctx.retries, batch_parts=ctx.batch_parts)
        if ctx.progress is not None:
            ctx.progress.update(len(out))
        return out

    async def run_group(group: list[Sample]) -> list[Sample]:
        if by_group and group_request_ok(group, sampling):
            group = await run_fresh_group(group)
        else:
            group = list(await asyncio.gather(*(run_sample(s) for s in group)))
        if any(s.status == STATUS_ABORTED for s in group):
            return group  # not scored: it goes back to the buffer
        result = await ctx.rewards.ascore(group, group_size=len(group), assign=True)
        counts["reward_errors"] += result.num_errors
        return group

    kept: list[list[Sample]] = []
    back: list[list[Sample]] = []
    pending: dict[asyncio.Task, list[Sample]] = {}

    async with aiohttp.ClientSession() as session:
        ctx.session = session
        try:
            while len(kept) < target:
                while len(kept) + len(pending) < target:
                    if counts["launched_groups"] >= MAX_GROUPS_FACTOR * max(target, over):
                        raise RuntimeError(
                            f"rollout {rollout_id}: generated {counts['launched_groups']} groups but the dynamic "
                            f"sampling filter kept only {len(kept)} of {target} (dropped: {dict(reasons)}); "
                            "check --dynamic-sampling-filter-path and the reward")
                    counts["sampling_rounds"] += 1
                    for group in ctx.data_source.get_samples(over):
                        for s in group:
                            s.rollout_step = rollout_id
                        counts["launched_groups"] += 1
                        pending[asyncio.ensure_future(run_group(group))] = group
                done, _ = await asyncio.wait(list(pending), return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: pending[t][0].group_index):
                    pending.pop(task)
                    group = task.result()
                    if any(s.status == STATUS_ABORTED for s in group):
                        back.append(group)
                        continue
                    counts["generated_groups"] += 1
                    counts["generated_samples"] += len(group)
                    if dyn_filter is not None:
                        keep, reason = filter_verdict(dyn_filter, args, group)
                        if not keep:
                            reasons[reason] += 1
                            filtered_samples[reason] += len(group)
                            continue
                    if len(kept) < target:
                        kept.append(group)
                    else:
                        back.append(group)
                        counts["surplus_samples"] += len(group)
            if pending:  # the target is reached: stop what is still running
                stopping.set()
                rids = [s.metadata["rid"] for g in pending.values() for s in g
                        if "rid" in s.metadata and not is_generated(s) and not exempt(s)]
                await ctx.abort(rids)
                for group in await asyncio.gather(*pending):
                    back.append(group)
                pending.clear()
        finally:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            ctx.session = None

    for group in back:
        aborted = [s for s in group if s.status == STATUS_ABORTED]
        counts["aborted_samples"] += len(aborted)
        if partial:
            for s in aborted:
                if s.response_tokens:
                    s.metadata["aborted_count"] = s.metadata.get("aborted_count", 0) + 1
        else:
            reset_group(group)
    if back:
        ctx.data_source.add_samples(back)
    kept.sort(key=lambda g: g[0].group_index)
    metrics = {
        "rollout/filtered_groups": float(sum(reasons.values())),
        "rollout/returned_groups": float(len(back)),
        "rollout/aborted_samples": float(counts["aborted_samples"]),
        "rollout/generated_groups": float(counts["generated_groups"]),
        "rollout/sampling_rounds": float(counts["sampling_rounds"]),
        "rollout/reward_errors": float(counts["reward_errors"]),
    }
    for reason, n in reasons.items():
        metrics[f"rollout/filtered_groups/{reason}"] = float(n)
    metrics.update(rollout_accounting(
        generated=counts["generated_samples"], kept=sum(len(g) for g in kept), filtered=filtered_samples,
        returned_surplus=counts["surplus_samples"],
        returned_in_flight=sum(len(g) for g in back) - counts["surplus_samples"]))
    metrics["samples/reward_failed"] = float(counts["reward_errors"])
    return RolloutOutput(groups=kept, metrics=metrics)
