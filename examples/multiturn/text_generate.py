"""The calculator agent of `tool_generate.py`, written the way text-based agent frameworks work: it sends
the conversation as text and reads text back, and never handles a token id. It trains on exactly the
engine's tokens all the same, through Relax's router and its radix-tree token cache::

    --use-slime-router
    --slime-router-middleware-paths relax.backends.relax_router.radix_middleware.RadixTreeMiddleware
    --custom-generate-function-path examples.multiturn.text_generate.generate
    --custom-rm-path examples.multiturn.tool_generate.reward        # optional

Each turn posts `{"text": conversation so far}` to the router's /generate; the router sends the engine
the cached tokens of the longest conversation prefix it has seen (the prompt, then each earlier turn
exactly as generated) plus the tokenised new text (the tool's answer). At the end the agent asks the
router for the tokens, log-probs and loss mask of its whole conversation (/retrieve_from_text): engine
tokens carry loss 1, the prompt and tool answers 0. Re-tokenising the final text instead would not give
the engine's tokens back in general (e.g. tokens that are not valid UTF-8 on their own decode to U+FFFD).
"""

from __future__ import annotations

from typing import Any

import aiohttp

from examples.multiturn.tool_generate import run_tool, tool_turn
from relax.wire.auth import auth_headers
from relax.data.sample import STATUS_ABORTED, STATUS_COMPLETED, STATUS_TRUNCATED, Sample
from relax.rollout.generate import post_generate
from relax.rollout.prompts import PromptEncoder

NEEDS = ("--use-slime-router --slime-router-middleware-paths "
         "relax.backends.relax_router.radix_middleware.RadixTreeMiddleware")


async def retrieve(ctx: Any, text: str) -> dict:
    """The router's tokens, log-probs and loss mask of `text` (radix-tree middleware)."""
    async with ctx.session.post(ctx.router_url + "/retrieve_from_text", json={"text": text}, headers=auth_headers(),
                                timeout=aiohttp.ClientTimeout(total=ctx.timeout_s)) as resp:
        body = await resp.json(content_type=None)
        if resp.status != 200 or not isinstance(body, dict) or "tokens" not in body:
            raise RuntimeError(f"examples.multiturn.text_generate needs {NEEDS}; the router answered "
                               f"/retrieve_from_text with HTTP {resp.status}: {str(body)[:200]}")
    return body


async def generate(ctx: Any, sample: Sample, sampling_params: dict) -> Sample:
    max_turns = int(sample.metadata.get("max_turns", 3))
    turn_tokens = int(sample.metadata.get("max_turn_tokens", 16))
    budget = int(sampling_params["max_new_tokens"])
    prompt = PromptEncoder.from_args(ctx.args, ctx.tokenizer).render(sample.prompt)
    text, used = prompt, 0  # `used`: response tokens so far (the engine's count, and the tool answers')
    generated = 0  # the engine's tokens: the router must give back exactly as many with loss 1
    status = STATUS_TRUNCATED
    turns = tool_calls = 0
    version = sample.weight_version
    for _ in range(max_turns):
        room = budget - used
        if room <= 0:
            break
        params = dict(sampling_params, max_new_tokens=min(turn_tokens, room))
        reply = await post_generate(ctx.session, ctx.router_url, {"text": text, "sampling_params": params},
                                    timeout_s=ctx.timeout_s, retries=ctx.retries, what=sample.describe())
        meta = reply.get("meta_info", {})
        turns += 1
        n_new = int(meta.get("completion_tokens", len(reply.get("output_ids", []))))
        used += n_new
        generated += n_new
        text += reply["text"]
        version = meta.get("weight_version", version)
        finish = (meta.get("finish_reason") or {}).get("type")
        if finish == "abort":
            status = STATUS_ABORTED
            break
        result = run_tool(reply["text"])
        if result is None and finish == "stop":
            status = STATUS_COMPLETED
            break
        if result is not None:
            tool_calls += 1
        observation = tool_turn(result if result is not None else "no tool call; write calc(<expression>)")
        # the router tokenises the observation the same way (the text after its cached prefix)
        n_obs = len(ctx.tokenizer.encode(observation, add_special_tokens=False))
        if used + n_obs >= budget:
            break
        used += n_obs
        text += observation
    got = await retrieve(ctx, text)
    n = len(sample.prompt_tokens)
    if got["tokens"][:n] != list(sample.prompt_tokens):
        raise RuntimeError(f"{sample.describe()}: the router's tokens of the prompt differ from the sample's "
                           "prompt tokens (a different tokenizer, or special tokens added?)")
    if sum(got["loss_mask"]) != generated:
        raise RuntimeError(f"{sample.describe()}: the router's radix cache gave {sum(got['loss_mask'])} engine tokens "
                           f"for a conversation of {generated} (an entry dropped while the conversation ran? see "
                           "its `evictions` at /radix_cache/stats)")
    sample.response_tokens = got["tokens"][n:]
    sample.response_logprobs = [float(x) for x in got["logprobs"][n:]]
    sample.loss_mask = [int(x) for x in got["loss_mask"][n:]]
    sample.response_text = text[len(prompt):]
    sample.status = status
    try:
        sample.weight_version = int(version)
    except (TypeError, ValueError):
        pass
    sample.metadata.update(turns=turns, tool_calls=tool_calls)
    return sample
