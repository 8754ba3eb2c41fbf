"""A multi-turn tool-use rollout for Relax: a calculator tool, token in / token out.

Use it with::

    --custom-generate-function-path examples.multiturn.tool_generate.generate
    --custom-rm-path examples.multiturn.tool_generate.reward        # optional

(run from the repository root with PYTHONPATH=. so `examples` is importable; see run-cpu.sh).

Each model turn is one engine call on the exact token ids so far (prompt + every earlier turn +
every tool answer); the engine's tokens and log-probs are appended as they are (loss_mask 1). When a
turn holds a tool call `calc(<expression>)`, the tool answer is appended as a ChatML `tool` turn
(loss_mask 0, log-prob 0.0) and the assistant speaks again; a turn without a tool call that ends
with the end-of-turn token finishes the sample. Nothing is re-tokenized, so the trainer sees exactly
the tokens the engine produced, and only those carry loss.

Per-sample knobs (prompt metadata): `max_turns` (default 3), `max_turn_tokens` (default 16). The
response budget of the whole conversation is --rollout-max-response-len (model and tool tokens).
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from relax.data.sample import STATUS_ABORTED, STATUS_COMPLETED, STATUS_TRUNCATED, Sample

CALL = re.compile(r"calc\(([^()]{1,64})\)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod,
        ast.FloorDiv: operator.floordiv, ast.USub: operator.neg}


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("unsupported expression")


def run_tool(text: str) -> str | None:
    """The calculator: the answer to the last `calc(...)` in `text`, an error text, or None (no call)."""
    calls = CALL.findall(text)
    if not calls:
        return None
    try:
        return str(_eval(ast.parse(calls[-1], mode="eval")))
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {type(exc).__name__}"


def tool_turn(result: str) -> str:
    return f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"


async def generate(ctx: Any, sample: Sample, sampling_params: dict) -> Sample:
    tokenizer = ctx.tokenizer
    max_turns = int(sample.metadata.get("max_turns", 3))
    turn_tokens = int(sample.metadata.get("max_turn_tokens", 16))
    budget = int(sampling_params["max_new_tokens"])
    tokens: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    texts: list[str] = []
    status = STATUS_TRUNCATED
    turns = tool_calls = 0
    for _ in range(max_turns):
        room = budget - len(tokens)
        if room <= 0:
            break
        params = dict(sampling_params, max_new_tokens=min(turn_tokens, room))
        reply = await ctx.engine_generate(sample.prompt_tokens + tokens, params)
        turns += 1
        tokens += reply.tokens
        logprobs += reply.logprobs
        mask += [1] * len(reply.tokens)
        texts.append(reply.text)
        sample.weight_version = reply.weight_version
        if reply.finish == "abort":
            status = STATUS_ABORTED
            break
        result = run_tool(reply.text)
        if result is None and reply.finish == "stop":
            status = STATUS_COMPLETED
            break
        if result is not None:
            tool_calls += 1
        observation = tool_turn(result if result is not None else "no tool call; write calc(<expression>)")
        obs_ids = tokenizer.encode(observation, add_special_tokens=False)
        if len(tokens) + len(obs_ids) >= budget:
            break
        tokens += obs_ids
        logprobs += [0.0] * len(obs_ids)
        mask += [0] * len(obs_ids)
        texts.append(observation)
    sample.response_tokens, sample.response_logprobs, sample.loss_mask = tokens, logprobs, mask
    sample.response_text = "".join(texts)
    sample.status = status
    sample.metadata.update(turns=turns, tool_calls=tool_calls)
    return sample


def reward(args: Any, sample: Sample) -> float:
    """1.0 when the final turn states the label, 0.5 for a well-formed tool call, else 0.0."""
    final = sample.response_text.rsplit("<|im_start|>assistant\n", 1)[-1]
    if sample.label is not None and str(sample.label).strip() and str(sample.label).strip() in final:
        return 1.0
    return 0.5 if sample.metadata.get("tool_calls") else 0.0
