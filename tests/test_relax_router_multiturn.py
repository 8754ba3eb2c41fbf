"""The text-based multi-turn agent (examples/multiturn/text_generate.py) through Relax's router with the
radix-tree token cache, against a real embedded engine (no Ray): what the trainer gets is exactly what
the engine generated, token for token, with the engine's log-probs, while re-tokenising the same
conversation text would not give those tokens back."""

import json
import os

import pytest
import torch
from transformers import AutoTokenizer

from conftest import ROOT, shared_tiny_model

from relax.backends.embedded.launcher import EmbeddedServerProcess
from relax.backends.relax_router.process import RelaxRouterProcess
from relax.config import parse_config
from relax.rollout.buffer import build_data_source
from relax.rollout.context import RolloutContext, load_hook
from relax.rollout.prompts import PromptEncoder
from relax.rollout.rewards import RewardRunner
from relax.training.advantages import trainer_inputs

RECORD_ENV = "RELAX_TEST_ROUTER_RECORD"
RADIX = "relax.backends.relax_router.radix_middleware.RadixTreeMiddleware"


class Recorder:
    """Runs after the radix middleware: writes what each engine was sent and answered (one JSON line each)."""

    def __init__(self, router):
        self.path = os.environ[RECORD_ENV]

    async def handle(self, request, call_next):
        resp = await call_next(request)
        if request.path == "/generate" and resp.status == 200 and isinstance(resp.body, dict):
            pairs = resp.body["meta_info"]["output_token_logprobs"]
            with open(self.path, "a") as f:
                f.write(json.dumps({"input_ids": request.body["input_ids"], "output_ids": [p[1] for p in pairs],
                                    "logprobs": [p[0] for p in pairs]}) + "\n")
        return resp


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    base = tmp_path_factory.mktemp("router_multiturn")
    model = str(shared_tiny_model())
    record = base / "engine_calls.jsonl"
    data = base / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"Use calc(...) to compute {a}+{b}.", "label": str(a + b),
                                        "metadata": {"max_turns": 3}}) + "\n" for a in range(2) for b in range(2)))
    saved = {k: os.environ.get(k) for k in (RECORD_ENV, "PYTHONPATH")}
    os.environ[RECORD_ENV] = str(record)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT)] + ([saved["PYTHONPATH"]]
                                                                                  if saved["PYTHONPATH"] else []))
    engine = EmbeddedServerProcess(model, server_args={"random_seed": 0, "dtype": "float32"})
    router = RelaxRouterProcess(request_timeout_s=60, tokenizer=model, log_path=str(base / "router.log"),
                                middleware_paths=(RADIX, "test_relax_router_multiturn.Recorder"))
    try:
        engine.start()
        router.start()
        engine.wait_healthy(120)
        router.add_worker(engine.url)
        yield base, model, str(data), record, router, engine
    finally:
        router.stop()
        engine.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_text_agent_trains_on_exactly_the_engine_tokens(stack):
    base, model, data, record, router, engine = stack
    cfg = parse_config(["--hf-checkpoint", model, "--prompt-data", data, "--apply-chat-template", "--label-key",
                        "label", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1",
                        "--rollout-max-response-len", "96", "--use-slime-router",
                        "--slime-router-middleware-paths", RADIX,
                        "--custom-generate-function-path", "examples.multiturn.text_generate.generate",
                        "--custom-rm-path", "examples.multiturn.tool_generate.reward",
                        "--output-dir", str(base / "out")])
    tok = AutoTokenizer.from_pretrained(model)
    ctx = RolloutContext(args=cfg, tokenizer=tok, data_source=build_data_source(cfg),
                         rewards=RewardRunner.from_args(cfg), router_url=router.url, engine_urls=[engine.url])
    samples = [s for g in load_hook(cfg.rollout_function_path, "--rollout-function-path")(ctx, 0).groups for s in g]
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    by_context: dict = {}
    for c in calls:  # the samples of a group share their first context
        by_context.setdefault(tuple(c["input_ids"]), []).append(c)
    render = PromptEncoder.from_args(cfg, tok).render
    drift = tool_turns = 0
    matched_calls = 0
    for s in samples:
        assert len(s.response_tokens) == len(s.loss_mask) == len(s.response_logprobs) > 0
        runs, start = [], 0
        for i in range(1, len(s.loss_mask) + 1):
            if i == len(s.loss_mask) or s.loss_mask[i] != s.loss_mask[start]:
                runs.append((s.loss_mask[start], start, i))
                start = i
        for m, a, b in runs:
            seg = s.response_tokens[a:b]
            if m == 1:
                # the engine was called on exactly the tokens before this run and produced exactly this run
                same = by_context[tuple(s.prompt_tokens + s.response_tokens[:a])]
                call = next(c for c in same if c["output_ids"] == seg)
                same.remove(call)
                assert call["logprobs"] == s.response_logprobs[a:b]
                matched_calls += 1
            else:
                tool_turns += 1
                assert tok.decode(seg).startswith("\n<|im_start|>tool\n")
                assert s.response_logprobs[a:b] == [0.0] * len(seg)
        assert s.metadata["turns"] == sum(1 for m, _, _ in runs if m == 1)
        retokenised = tok.encode(render(s.prompt) + s.response_text, add_special_tokens=False)
        drift += retokenised != s.prompt_tokens + s.response_tokens
    assert matched_calls == len(calls)  # and every engine call is in a sample
    assert tool_turns > 0
    assert drift > 0, "re-tokenising gave the engine's tokens back for every sample: the check proves nothing"
    for x, s in zip(trainer_inputs(samples, torch.zeros(len(samples))), samples):
        assert x["tokens"].tolist() == s.prompt_tokens + s.response_tokens
        assert x["loss_mask"].tolist() == [float(v) for v in s.loss_mask]
    stats = router._call("GET", "/radix_cache/stats").json()
    assert stats["hits"] >= tool_turns and stats["conflicts"] == 0
