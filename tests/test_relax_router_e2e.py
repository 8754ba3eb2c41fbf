"""A real run (Ray, Megatron on CPU, an embedded engine) behind Relax's router: the text-only multi-turn
agent with the radix-tree token cache trains on the engine's own tokens, so the trainer's log-probs of
the trained tokens match the engine's (before the first update the weights are the same)."""

import json

import pytest

from conftest import run_steps

from relax.config import parse_config

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')


def no_correction(pg_loss, train_logprobs, rollout_logprobs, mask):
    """--custom-tis-function-path that changes nothing (--get-mismatch-metrics asks for one)."""
    return pg_loss, mask, {}


def test_run_through_relax_router_with_text_agent(tiny_model, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"Use calc(...) to compute {a}+{b}.", "label": str(a + b),
                                        "metadata": {"max_turns": 2, "max_turn_tokens": 8}}) + "\n"
                            for a in range(2) for b in range(2)))
    out = tmp_path / "run"
    cfg = parse_config([
        "--hf-checkpoint", tiny_model, "--prompt-data", str(data), "--apply-chat-template", "--label-key", "label",
        "--use-slime-router", "--slime-router-timeout", "120", "--slime-router-max-connections", "16",
        "--slime-router-health-check-failure-threshold", "3",
        "--slime-router-middleware-paths", "relax.backends.relax_router.radix_middleware.RadixTreeMiddleware",
        "--custom-generate-function-path", "examples.multiturn.text_generate.generate",
        "--custom-rm-path", "examples.multiturn.tool_generate.reward", "--log-multi-turn", "--get-mismatch-metrics",
        "--custom-tis-function-path", "test_relax_router_e2e.no_correction",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--rollout-max-response-len", "100", "--micro-batch-size", "4", "--lr", "1e-4", "--lr-decay-style", "constant",
        "--distributed-backend", "gloo", "--resource", '{"actor": [1, 1], "rollout": [1, 1]}',
        "--output-dir", str(out)])
    records = run_steps(cfg)
    step = [r for r in records if "rollout/num_samples" in r][0]
    assert step["rollout/num_samples"] == 4
    assert step["multi_turn/turns_max"] == 2 and step["multi_turn/env_tokens_mean"] > 0  # tool turns in between
    # before the first update the trainer scores the trained tokens exactly as the engine did (measured: 1e-7 on
    # average): what is trained is what was generated, on the same context
    assert step["train/mismatch_logprob_abs_diff_mean"] < 1e-4
    log = (out / "logs" / "router.log").read_text()
    assert "relax router on" in log and "RadixTreeMiddleware" in log
