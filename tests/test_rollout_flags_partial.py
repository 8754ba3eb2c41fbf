"""--partial-rollout-max-aborted-count N through the default rollout function and a real embedded engine:
when a step reaches its target while groups are still running, a sample already aborted N times is not
aborted again but runs to completion (continuing its partial response); below N it is aborted again
and its count grows."""

import json

import pytest

from conftest import shared_tiny_model

from relax.backends.embedded.launcher import EmbeddedServerProcess
from relax.config import parse_config
from relax.rollout.buffer import build_data_source
from relax.rollout.context import RolloutContext, load_hook
from relax.rollout.rewards import RewardRunner

PREFIX = [65, 66, 67]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("partial")
    model = shared_tiny_model()
    data = base / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(6)))
    return base, str(model), str(data)


@pytest.fixture(scope="module")
def engine(assets):
    proc = EmbeddedServerProcess(assets[1], server_args={"random_seed": 0, "max_running_requests": 8,
                                                         "dtype": "float32"})
    proc.start()
    try:
        proc.wait_healthy(180)
        yield proc.url
    finally:
        proc.stop()


def step_with_resumable_sample(assets, url, max_count: int, aborted_before: int):
    """One rollout step (target 1 group, 2 served): group A is finished already (from the buffer), group
    B holds a fresh sample and a sample aborted `aborted_before` times with a partial response. Only one
    request runs at a time, so B's partial sample waits behind B's fresh one and the step reaches its
    target (A) while B is still running."""
    from transformers import AutoTokenizer

    base, model, data = assets
    cfg = parse_config(["--hf-checkpoint", model, "--prompt-data", data, "--apply-chat-template",
                        "--label-key", "label", "--rm-type", "random", "--partial-rollout",
                        "--partial-rollout-max-aborted-count", str(max_count), "--rollout-batch-size", "1",
                        "--over-sampling-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
                        "--rollout-max-response-len", "40", "--output-dir", str(base / "out")])
    source = build_data_source(cfg)
    group_a, group_b = source.get_samples(2)
    for s in group_a:
        s.response_tokens, s.response_logprobs, s.loss_mask, s.status = [70, 71], [-1.0, -1.0], [1, 1], "completed"
    resumable = group_b[1]
    resumable.response_tokens, resumable.response_logprobs = list(PREFIX), [-0.5] * len(PREFIX)
    resumable.loss_mask, resumable.status = [1] * len(PREFIX), "aborted"
    resumable.metadata["aborted_count"] = aborted_before
    source.add_samples([group_a, group_b])
    ctx = RolloutContext(args=cfg, tokenizer=AutoTokenizer.from_pretrained(model), data_source=source,
                         rewards=RewardRunner.from_args(cfg), router_url=url, engine_urls=[url], max_concurrency=1)
    out = load_hook(cfg.rollout_function_path, "--rollout-function-path")(ctx, 0)
    return out, source, group_a, group_b, resumable


def test_a_sample_aborted_max_times_runs_to_completion(assets, engine):
    out, source, group_a, group_b, s = step_with_resumable_sample(assets, engine, max_count=1, aborted_before=1)
    assert out.groups == [group_a]
    assert source.buffer == [group_b]  # B went back to the buffer ...
    # ... with its exempt sample finished: the partial response continued, not restarted
    assert s.status in ("completed", "truncated") and len(s.response_tokens) > len(PREFIX)
    assert s.response_tokens[:len(PREFIX)] == PREFIX and s.response_logprobs[:len(PREFIX)] == [-0.5] * len(PREFIX)
    assert len(s.response_tokens) <= 40 and len(s.response_logprobs) == len(s.response_tokens)
    assert s.metadata["aborted_count"] == 1 and s.metadata["resumed_tokens"] == len(PREFIX)
    # only B's fresh sample could have been aborted
    assert out.metrics["rollout/aborted_samples"] == float(group_b[0].status == "aborted")


def test_below_the_limit_the_sample_is_aborted_again(assets, engine):
    out, source, group_a, group_b, s = step_with_resumable_sample(assets, engine, max_count=2, aborted_before=1)
    assert out.groups == [group_a] and source.buffer == [group_b]
    assert s.status == "aborted" and s.response_tokens[:len(PREFIX)] == PREFIX
    assert s.metadata["aborted_count"] == 2
    assert out.metrics["rollout/aborted_samples"] >= 1


def test_the_limit_needs_partial_rollout(assets):
    from relax.config.errors import ConfigError

    base, model, data = assets
    with pytest.raises(ConfigError, match="--partial-rollout-max-aborted-count has no effect without --partial"):
        parse_config(["--hf-checkpoint", model, "--partial-rollout-max-aborted-count", "2"])
    with pytest.raises(ConfigError, match="partial-rollout-max-aborted-count"):
        parse_config(["--hf-checkpoint", model, "--partial-rollout", "--partial-rollout-max-aborted-count", "0"])
