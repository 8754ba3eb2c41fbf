"""--log-multi-turn, --log-correct-samples, --log-reward-category and --eval-function-path.

The statistics are pure functions, checked against hand-computed values; then one run through the
controller (Ray, Megatron on CPU, an embedded engine behind sglang-router) with the multi-turn tool
example: the logged metrics equal the statistics recomputed from the step's saved samples, the correct
samples land in OUTPUT_DIR/correct_samples/, and the eval function generates the evaluation (and only
the evaluation)."""

import json
import os
from pathlib import Path

import pytest

from conftest import assert_ray_released, shared_ray, shared_tiny_model

from relax.data.sample import Sample
from relax.rollout.step_logs import (correct_metrics, mask_runs, multi_turn_metrics, reward_category_metrics,
                                     sample_turns, write_correct_samples)

ROOT = Path(__file__).resolve().parents[1]
EVAL_TOKENS = 1


def S(mask, reward=0.0, raw=None, index=0, **md):
    return Sample(index=index, response_tokens=list(range(len(mask))), response_logprobs=[0.0] * len(mask),
                  loss_mask=list(mask), reward=reward, raw_reward=raw, metadata=dict(md), response_text=f"r{index}")


# ---------------------------------------------------------------- pure statistics

def test_multi_turn_statistics_follow_the_loss_mask():
    assert mask_runs([1, 1, 0, 0, 0, 1, 0, 1, 1]) == [(1, 2), (0, 3), (1, 1), (0, 1), (1, 2)]
    # 3 model turns, 2 environment answers, 5 model tokens, 4 environment tokens
    a = S([1, 1, 0, 0, 0, 1, 0, 1, 1])
    b = S([1, 1, 1])                                  # single turn
    c = S([1, 0, 0, 1], turns=7, tool_calls=0)        # the generate function's own counts win
    assert sample_turns(a) == (3, 2, 5, 4) and sample_turns(b) == (1, 0, 3, 0) and sample_turns(c) == (7, 0, 2, 2)
    m = multi_turn_metrics([a, b, c])
    assert m["multi_turn/turns_mean"] == pytest.approx((3 + 1 + 7) / 3)
    assert m["multi_turn/turns_max"] == 7.0
    assert m["multi_turn/tool_calls_mean"] == pytest.approx(2 / 3) and m["multi_turn/tool_calls_total"] == 2.0
    assert m["multi_turn/model_tokens_mean"] == pytest.approx((5 + 3 + 2) / 3)
    assert m["multi_turn/env_tokens_mean"] == pytest.approx((4 + 0 + 2) / 3)
    assert m["multi_turn/env_token_fraction"] == pytest.approx(6 / 16)
    assert m["multi_turn/multi_turn_fraction"] == pytest.approx(2 / 3)
    assert multi_turn_metrics([]) == {}


def test_correct_samples_and_reward_categories(tmp_path):
    samples = [S([1] * 2, 1.0, {"score": 1.0, "cat": "math"}, 0), S([1] * 4, 0.0, {"score": 0.0, "cat": "math"}, 1),
               S([1] * 6, 0.5, {"score": 0.5, "cat": "code/py"}, 2), S([1], -1.0, 3.0, 3)]
    m = correct_metrics(samples)
    assert m == {"rollout/correct_samples": 2.0, "rollout/correct_fraction": 0.5,
                 "rollout/correct_response_len_mean": 4.0}
    path = write_correct_samples(str(tmp_path), 5, samples, limit=1)
    assert path == str(tmp_path / "correct_samples" / "step_5.jsonl")
    rows = [json.loads(x) for x in open(path)]
    assert [(r["index"], r["reward"], r["response"], r["step"]) for r in rows] == [(0, 1.0, "r0", 5)]
    c = reward_category_metrics(samples, "cat")
    assert c == {"reward_category/_missing/count": 1.0, "reward_category/_missing/fraction": 0.25,
                 "reward_category/_missing/reward_mean": -1.0,
                 "reward_category/code_py/count": 1.0, "reward_category/code_py/fraction": 0.25,
                 "reward_category/code_py/reward_mean": 0.5,
                 "reward_category/math/count": 2.0, "reward_category/math/fraction": 0.5,
                 "reward_category/math/reward_mean": 0.5}


def test_log_reward_category_rule(tmp_path):
    from relax.config import parse_config
    from relax.config.errors import ConfigError

    with pytest.raises(ConfigError, match="--log-reward-category"):
        parse_config(["--hf-checkpoint", str(tmp_path), "--log-reward-category", " "])


# ---------------------------------------------------------------- hooks used by the run below

def parity_reward(args, sample):
    """Even prompts are 'correct' (score 1), odd ones not; the category is the parity."""
    even = sample.metadata["prompt_index"] % 2 == 0
    return {"score": 1.0 if even else 0.0, "kind": "even" if even else "odd"}


async def short_eval(ctx, rollout_id, eval_set, groups):
    """Generates every eval sample with exactly EVAL_TOKENS new tokens and marks it."""
    params = dict(eval_set.sampling_params(), max_new_tokens=EVAL_TOKENS, ignore_eos=True)
    for g in groups:
        for s in g:
            reply = await ctx.engine_generate(s.prompt_tokens, params)
            s.response_tokens, s.response_logprobs = reply.tokens, reply.logprobs
            s.loss_mask, s.response_text = [1] * len(reply.tokens), reply.text
            s.metadata["short_eval"] = True
    with open(os.path.join(ctx.args.output_dir, "eval_calls.txt"), "a") as f:
        f.write(f"{rollout_id} {eval_set.name} {sum(len(g) for g in groups)}\n")
    return groups


@pytest.fixture(scope="module")
def assets(tmp_path_factory):

    base = tmp_path_factory.mktemp("flags_logging")
    model = shared_tiny_model()
    rows = [{"input": f"Use calc(...) to compute {a}+{b}.", "label": str(a + b), "metadata": {"max_turns": 3}}
            for a in range(2) for b in range(2)]
    data = base / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return base, str(model), str(data)


@pytest.mark.e2e
def test_logging_flags_and_eval_function_through_the_controller(assets, monkeypatch):
    from relax.config import parse_config
    from relax.core.controller import Controller
    from relax.rollout.debug_data import load_rollout_data

    base, model, data = assets
    here = str(Path(__file__).resolve().parent)  # Ray workers import the hooks from here and examples/
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                          if p]))
    out = base / "run"
    saved = str(base / "saved_{rollout_id}.jsonl")
    m = __name__
    config = parse_config([
        "--hf-checkpoint", model, "--prompt-data", data, "--apply-chat-template", "--label-key", "label",
        "--custom-generate-function-path", "examples.multiturn.tool_generate.generate",
        "--custom-rm-path", f"{m}.parity_reward", "--reward-key", "score",
        "--log-multi-turn", "--log-correct-samples", "--log-reward-category", "kind",
        "--eval-prompt-data", "tiny", data, "--eval-interval", "1", "--eval-max-response-len", "6",
        "--eval-function-path", f"{m}.short_eval",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--rollout-max-response-len", "160", "--micro-batch-size", "4", "--lr", "1e-4",
        "--lr-decay-style", "constant", "--resource", '{"actor": [1, 1], "rollout": [1, 1]}',
        "--distributed-backend", "gloo", "--save-debug-rollout-data", saved, "--output-dir", str(out)])
    shared_ray()
    controller = Controller(config)
    try:
        controller.start()
        controller.run()
    finally:
        controller.shutdown()
    assert_ray_released()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    pre, step = records[0], records[-1]
    samples = load_rollout_data(saved, 0)
    assert len(samples) == 4

    # multi-turn statistics of the step = the statistics of its samples; the example adds tool turns
    want = multi_turn_metrics(samples)
    assert {k: v for k, v in step.items() if k.startswith("multi_turn/")} == pytest.approx(want)
    assert step["multi_turn/env_tokens_mean"] > 0 and step["multi_turn/turns_mean"] >= 1
    assert step["multi_turn/tool_calls_total"] == sum(s.metadata["tool_calls"] for s in samples)
    assert step["multi_turn/turns_mean"] == pytest.approx(sum(s.metadata["turns"] for s in samples) / 4)

    # correct samples: the even prompt's group (prompts 0 and 1 of the file: one even, one odd)
    even = [s for s in samples if s.metadata["prompt_index"] % 2 == 0]
    assert step["rollout/correct_samples"] == len(even) == 2 and step["rollout/correct_fraction"] == 0.5
    rows = [json.loads(x) for x in (out / "correct_samples" / "step_0.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == sorted(s.index for s in even)
    assert {r["response"] for r in rows} == {s.response_text for s in even} and all(r["reward"] == 1.0 for r in rows)

    # reward categories from the dict reward's "kind"
    assert step["reward_category/even/count"] == 2.0 and step["reward_category/odd/count"] == 2.0
    assert step["reward_category/even/reward_mean"] == 1.0 and step["reward_category/odd/reward_mean"] == 0.0
    assert step["reward_category/even/fraction"] == 0.5 and "reward_category/_missing/count" not in step

    # the eval function generated the evaluation (before training and after the step), not the rollout
    calls = (out / "eval_calls.txt").read_text().split("\n")[:-1]
    assert calls == ["0 tiny 4", "1 tiny 4"]
    for rec in (pre, step):
        assert rec["eval/tiny/num_samples"] == 4.0 and rec["eval/tiny/response_len_mean"] == EVAL_TOKENS
    assert not any("short_eval" in s.metadata for s in samples)
    assert step["rollout/response_len_mean"] > EVAL_TOKENS
