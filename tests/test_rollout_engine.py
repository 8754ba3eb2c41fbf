"""Rollout pieces against a real embedded engine (no Ray): the default rollout function with
over-sampling, dynamic and buffer filters; evaluation and pass@k; sampling flags; the multi-turn
tool-use example (token in / token out, loss masks); partial rollout."""

import asyncio
import json

import pytest

from conftest import shared_tiny_model

from relax.backends.embedded.launcher import EmbeddedServerProcess
from relax.config import parse_config
from relax.observability.accounting import step_problems
from relax.rollout.buffer import RolloutDataSourceWithBuffer, build_data_source
from relax.rollout.context import RolloutContext, load_hook
from relax.rollout.rewards import RewardRunner

N_PROMPTS = 12


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("rollout")
    model = shared_tiny_model()
    data = base / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i % 10),
                                        "metadata": {"odd": i % 2}}) + "\n" for i in range(N_PROMPTS)))
    return base, str(model), str(data)


@pytest.fixture(scope="module")
def engine(assets):
    proc = EmbeddedServerProcess(assets[1], server_args={"random_seed": 0, "max_running_requests": 64,
                                                         "dtype": "float32"})
    proc.start()
    try:
        proc.wait_healthy(120)
        yield proc.url
    finally:
        proc.stop()


def make_config(assets, *extra):
    base, model, data = assets
    return parse_config(["--hf-checkpoint", model, "--prompt-data", data, "--apply-chat-template",
                         "--label-key", "label", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                         "--num-rollout", "1", "--rollout-max-response-len", "4",
                         "--output-dir", str(base / "out"), *extra])


def make_ctx(config, url, source=None, group_requests=False, max_concurrency=64):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(config.hf_checkpoint)
    return RolloutContext(args=config, tokenizer=tok, data_source=source or build_data_source(config),
                          rewards=RewardRunner.from_args(config), router_url=url, engine_urls=[url],
                          group_requests=group_requests, max_concurrency=max_concurrency)


def rollout(ctx, step=0):
    return load_hook(ctx.args.rollout_function_path, "--rollout-function-path")(ctx, step)


# ---------------------------------------------------------------- hooks, filters, buffer

def odd_prompt_filter(args, group):
    """Drops prompts with odd metadata (deterministic), giving a reason."""
    return (group[0].metadata["odd"] == 0, "odd_prompt")


def last_first(args, buffer, num_groups):
    return list(reversed(buffer))[:num_groups]


def index_reward(args, sample):
    return float(sample.metadata["prompt_index"] % 3 == 0)


def test_default_hook_paths_are_the_real_defaults(assets, monkeypatch):
    """The reference's defaults name the hooks' old modules (relax.engine.*): the loader reads them as the modules
    that hold the code now (relax.config.hook_paths), silently for a default and with one warning for a path a
    user gives."""
    from relax.config import validate
    from relax.rollout.filters import check_reward_nonzero_std
    from relax.rollout.sglang_rollout import generate_rollout as real

    warnings = []
    monkeypatch.setattr(validate.logger, "warning", lambda fmt, *args: warnings.append(fmt % args))
    config = make_config(assets)
    assert config.rollout_function_path.startswith("relax.engine.") and "rollout_function_path" not in config.explicit
    assert load_hook(config.rollout_function_path, "x") is real
    assert type(build_data_source(config)) is RolloutDataSourceWithBuffer
    assert not [w for w in warnings if "moved" in w]
    # a path given that equals the default is the default; another old path is read as its new one, with a warning
    old = "relax.engine.filters.dynamic_sampling_filters.check_reward_nonzero_std"
    given = make_config(assets, "--dynamic-sampling-filter-path", old)
    assert load_hook(given.dynamic_sampling_filter_path, "x") is check_reward_nonzero_std
    assert [w for w in warnings if "moved" in w] == [
        f"--dynamic-sampling-filter-path {old}: the module moved to relax.rollout.filters; the old path keeps "
        "working, relax.rollout.filters.check_reward_nonzero_std is the current one"]


@pytest.mark.parametrize("group_requests", [False, True], ids=["per-sample", "per-group"])
def test_over_sampling_with_dynamic_filter_returns_surplus_to_buffer(assets, engine, group_requests):
    config = make_config(assets, "--over-sampling-batch-size", "3", "--rm-type", "random",
                         "--dynamic-sampling-filter-path", f"{__name__}.odd_prompt_filter")
    ctx = make_ctx(config, engine, group_requests=group_requests)
    out = rollout(ctx)
    assert len(out.groups) == 2 and all(len(g) == 2 for g in out.groups)
    assert all(g[0].metadata["odd"] == 0 for g in out.groups)
    assert all(s.response_tokens and len(s.loss_mask) == len(s.response_tokens) for g in out.groups for s in g)
    m = out.metrics
    # round 1: prompts 0,1,2 -> keeps 0 and 2, drops 1; nothing else needed (target 2)
    assert m["rollout/filtered_groups"] == 1 and m["rollout/filtered_groups/odd_prompt"] == 1
    assert m["rollout/generated_groups"] == 3 and m["rollout/sampling_rounds"] == 1
    # the same in samples (sample accounting): 3 groups of 2 generated = 2 kept + 1 filtered
    assert (m["samples/generated"], m["samples/kept"], m["samples/filtered/odd_prompt"]) == (6, 4, 2)
    assert step_problems(m, trained_expected=False) == []
    # a round bigger than needed: the completed surplus goes back to the buffer and is served first next time
    config2 = make_config(assets, "--over-sampling-batch-size", "3", "--rm-type", "random")
    ctx2 = make_ctx(config2, engine, group_requests=group_requests)
    out2 = rollout(ctx2)
    assert [g[0].metadata["prompt_index"] for g in out2.groups] == [0, 1]
    m2 = out2.metrics
    # the third group either finished with the others (surplus) or was still running and was aborted
    assert m2["rollout/filtered_groups"] == 0 and m2["rollout/generated_groups"] in (2, 3)
    assert m2["rollout/aborted_samples"] <= 2
    returned = ctx2.data_source.buffer
    assert len(returned) == m2["rollout/returned_groups"] == 1
    assert m2["samples/returned_surplus"] + m2["samples/returned_in_flight"] == 2
    assert m2["samples/generated"] == m2["samples/kept"] + m2["samples/returned_surplus"]
    assert step_problems(m2, trained_expected=False) == []
    assert returned[0][0].metadata["prompt_index"] == 2
    assert all(not s.response_tokens for g in returned for s in g)  # back as prompts: generated again later
    nxt = ctx2.data_source.get_samples(1)[0]
    assert nxt[0].metadata["prompt_index"] in {g[0].metadata["prompt_index"] for g in returned}


def test_group_requests_answer_the_same_whatever_the_batching(assets, engine):
    """A prompt group as one request (SGLang's `n`): every copy has its own seeded stream, so the answers
    depend on (--rollout-seed, step, group, place) only, not on how many groups run at once; the copies
    of a group differ from each other."""
    answers = []
    for concurrency in (2, 64):  # one group at a time, then all groups at once
        config = make_config(assets, "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                             "--rollout-max-response-len", "6", "--rollout-seed", "7", "--rm-type", "random")
        ctx = make_ctx(config, engine, group_requests=True, max_concurrency=concurrency * 4)
        out = rollout(ctx)
        assert len(out.groups) == 4 and all(len(g) == 4 for g in out.groups)
        for g in out.groups:
            assert len({s.metadata["rid"] for s in g}) == 4
            assert all(len(s.response_logprobs) == len(s.response_tokens) == len(s.loss_mask) for s in g)
        answers.append([[s.response_tokens for s in g] for g in out.groups])
    assert answers[0] == answers[1]
    assert all(len({tuple(t) for t in g}) > 1 for g in answers[0])  # copies are not the same stream


def test_dapo_filter_drops_zero_variance_groups(assets, engine):
    # reward depends only on the prompt -> every group has zero reward spread -> all dropped, the step fails
    # with a message; with a prompt-dependent but sample-independent reward nothing can be kept.
    config = make_config(assets, "--custom-rm-path", f"{__name__}.index_reward",
                         "--dynamic-sampling-filter-path",
                         "relax.engine.filters.dynamic_sampling_filters.check_reward_nonzero_std")
    ctx = make_ctx(config, engine)
    import relax.rollout.sglang_rollout as sr

    old = sr.MAX_GROUPS_FACTOR
    sr.MAX_GROUPS_FACTOR = 3
    try:
        with pytest.raises(RuntimeError, match="check_reward_nonzero_std"):
            rollout(ctx)
    finally:
        sr.MAX_GROUPS_FACTOR = old


def test_buffer_filter_chooses_groups(assets):
    config = make_config(assets, "--buffer-filter-path", f"{__name__}.last_first")
    source = build_data_source(config)
    groups = source.get_samples(3)
    source.add_samples(groups)
    got = source.get_samples(2)
    assert got[0] is groups[2] and got[1] is groups[1]
    assert source.buffer == [groups[0]]
    state = json.loads(json.dumps(source.state_dict()))
    fresh = build_data_source(config)
    fresh.load_state_dict(state)
    assert [g[0].metadata["prompt_index"] for g in fresh.get_samples(2)] == [0, 3]


class CountingSource(RolloutDataSourceWithBuffer):
    served = 0

    def get_samples(self, n):
        CountingSource.served += n
        return super().get_samples(n)


def square_rollout(ctx, rollout_id):
    groups = ctx.data_source.get_samples(ctx.args.rollout_batch_size)
    for g in groups:
        for s in g:
            s.response_tokens, s.response_logprobs, s.loss_mask = [65, 66], [0.0, 0.0], [1, 1]
    return groups


def test_custom_data_source_and_rollout_function_are_used(assets):
    config = make_config(assets, "--data-source-path", f"{__name__}.CountingSource",
                         "--rollout-function-path", f"{__name__}.square_rollout")
    source = build_data_source(config)
    assert type(source) is CountingSource
    groups = load_hook(config.rollout_function_path, "x")(make_ctx(config, None, source), 0)
    assert CountingSource.served == 2 and groups[0][0].response_tokens == [65, 66]


# ---------------------------------------------------------------- evaluation

def test_eval_sets_metrics_passrate_and_eval_config_overrides(assets, engine, tmp_path):
    from relax.rollout.evaluation import eval_sets, evaluate, pass_at_k

    base, model, data = assets
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(f"eval:\n  defaults:\n    n_samples_per_eval_prompt: 4\n  datasets:\n"
                   f"    - name: small\n      path: {data}\n      max_response_len: 2\n"
                   f"    - name: wide\n      path: {data}\n      n_samples_per_eval_prompt: 2\n"
                   f"      rm_type: random\n      max_context_len: 25\n")
    config = make_config(assets, "--eval-config", str(cfg), "--eval-interval", "1", "--log-passrate",
                         "--custom-rm-path", f"{__name__}.index_reward", "--eval-max-response-len", "3")
    sets = eval_sets(config)
    assert [(s.name, s.n_samples_per_eval_prompt, s.max_response_len) for s in sets] == [
        ("small", 4, 2), ("wide", 2, 3)]
    ctx = make_ctx(config, engine)
    metrics, groups = evaluate(ctx, ctx.data_source.encoder, 5, sets)
    assert metrics["eval/small/num_samples"] == N_PROMPTS * 4
    assert metrics["eval/wide/num_samples"] == N_PROMPTS * 2
    assert all(len(s.response_tokens) <= 2 for g in groups["small"] for s in g)
    # custom reward: prompts 0,3,6,9 pass -> pass@k = 4/12 for every k
    for k in (1, 2, 4):
        assert metrics[f"eval/small/pass@{k}"] == pytest.approx(4 / 12)
    assert "eval/small/pass@8" not in metrics and "eval/wide/pass@2" in metrics
    # max_context_len 25 caps prompt + response
    assert all(len(s.prompt_tokens) + len(s.response_tokens) <= 25 for g in groups["wide"] for s in g)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5) and pass_at_k(4, 0, 1) == 0.0


def test_eval_flag_rules(assets, tmp_path):
    from relax.config.errors import ConfigError

    base, model, data = assets
    with pytest.raises(ConfigError, match="--eval-interval"):
        make_config(assets, "--eval-prompt-data", "a", data)
    with pytest.raises(ConfigError, match="unknown key"):
        bad = tmp_path / "bad.yaml"
        bad.write_text(f"datasets:\n  - name: a\n    path: {data}\n    temprature: 1\n")
        make_config(assets, "--eval-config", str(bad), "--eval-interval", "1")
    with pytest.raises(ConfigError, match="load-debug-rollout-data"):
        make_config(assets, "--debug-train-only")


# ---------------------------------------------------------------- sampling flags

def greedy_ids(url, prompt, n):
    import requests

    body = requests.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {
        "temperature": 1.0, "top_k": 1, "max_new_tokens": n, "ignore_eos": True}, "return_logprob": True},
        timeout=60).json()
    return [p[1] for p in body["meta_info"]["output_token_logprobs"]]


def test_sampling_flags_take_effect(assets, engine):
    from transformers import AutoTokenizer

    from relax.roles.rollout import engine_server_args
    from relax.rollout.generate import SamplingSettings

    base, model, data = assets
    tok = AutoTokenizer.from_pretrained(model)
    source_cfg = make_config(assets)
    prompt = build_data_source(source_cfg).get_samples(1)[0][0].prompt_tokens
    ref = greedy_ids(engine, prompt, 12)
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    stop_str = tok.decode([ref[3]])
    # greedy via top-k 1; --rollout-stop-token-ids / --rollout-stop end the response where they appear
    cfg = make_config(assets, "--rollout-top-k", "1", "--rollout-max-response-len", "12",
                      "--rollout-stop-token-ids", str(stop_tok), "--rollout-skip-special-tokens",
                      "--rm-type", "random", "--n-samples-per-prompt", "1", "--rollout-batch-size", "1")
    params = SamplingSettings.from_config(cfg).to_sglang()
    assert params["stop_token_ids"] == [stop_tok] and params["skip_special_tokens"] is True
    out = rollout(make_ctx(cfg, engine)).groups[0][0]
    assert out.response_tokens == ref[:first + 1] and out.status == "completed"
    cfg = make_config(assets, "--rollout-top-k", "1", "--rollout-max-response-len", "12", "--rollout-stop",
                      stop_str, "--rm-type", "random", "--n-samples-per-prompt", "1", "--rollout-batch-size", "1")
    out = rollout(make_ctx(cfg, engine)).groups[0][0]
    assert tok.decode(ref[:3]) in tok.decode(out.response_tokens) or len(out.response_tokens) <= 4
    assert len(out.response_tokens) < 12 and stop_str not in out.response_text
    cfg = make_config(assets, "--rollout-top-k", "1", "--rollout-max-response-len", "12", "--rm-type", "random",
                      "--n-samples-per-prompt", "1", "--rollout-batch-size", "1")
    out = rollout(make_ctx(cfg, engine)).groups[0][0]
    assert out.response_tokens == ref and out.status == "truncated"
    # the context limit reaches the engine at launch
    cfg = make_config(assets, "--rollout-max-context-len", "64")
    assert engine_server_args(cfg, "embedded")["context_length"] == 64
    # SGLang's prefix-cache switch is the embedded engine's shared-prompt prefill too: accepted and passed on
    assert "disable_radix_cache" not in engine_server_args(cfg, "embedded")
    cfg = make_config(assets, "--sglang-disable-radix-cache")
    assert engine_server_args(cfg, "embedded")["disable_radix_cache"] is True
    from relax.config.support import unsupported_flags
    assert unsupported_flags(cfg) == []


# ---------------------------------------------------------------- multi-turn tool use

def test_multiturn_tool_example_trains_exactly_the_engine_tokens(assets, engine):
    import torch

    from relax.backends.embedded.testing import load_reference_model, reference_logprobs
    from relax.training.advantages import trainer_inputs

    cfg = make_config(assets, "--custom-generate-function-path", "examples.multiturn.tool_generate.generate",
                      "--custom-rm-path", "examples.multiturn.tool_generate.reward",
                      "--rollout-max-response-len", "200")
    ctx = make_ctx(cfg, engine)
    out = rollout(ctx)
    samples = [s for g in out.groups for s in g]
    ref = load_reference_model(cfg.hf_checkpoint)
    tok = ctx.tokenizer
    saw_tool = False
    for s in samples:
        assert len(s.response_tokens) == len(s.loss_mask) == len(s.response_logprobs)
        # split into runs of model (mask 1) and environment (mask 0) tokens
        runs, start = [], 0
        for i in range(1, len(s.loss_mask) + 1):
            if i == len(s.loss_mask) or s.loss_mask[i] != s.loss_mask[start]:
                runs.append((s.loss_mask[start], start, i))
                start = i
        assert runs[0][0] == 1 and s.metadata["turns"] >= 1
        for m, a, b in runs:
            seg = s.response_tokens[a:b]
            if m == 0:
                saw_tool = True
                assert tok.decode(seg).startswith("\n<|im_start|>tool\n")
                assert tok.decode(seg).endswith("<|im_end|>\n<|im_start|>assistant\n")
                assert s.response_logprobs[a:b] == [0.0] * (b - a)
            else:
                # the engine produced these tokens given exactly the context before them
                lp = reference_logprobs(ref, s.prompt_tokens + s.response_tokens[:a], seg, 1.0)
                assert max(abs(x - y) for x, y in zip(lp, s.response_logprobs[a:b])) < 1e-3
        assert s.metadata["turns"] == sum(1 for m, _, _ in runs if m == 1)
    assert saw_tool
    inputs = trainer_inputs(samples, torch.zeros(len(samples)))
    for x, s in zip(inputs, samples):
        assert x["tokens"].tolist() == s.prompt_tokens + s.response_tokens
        assert x["loss_mask"].tolist() == [float(v) for v in s.loss_mask]


def test_multiturn_calculator_tool():
    from examples.multiturn.tool_generate import run_tool

    assert run_tool("so calc(2+3*4) it is") == "14"
    assert run_tool("calc(1/0)").startswith("error") and run_tool("nothing") is None
    assert run_tool("calc(os.system)").startswith("error") and run_tool("calc(__import__('os'))") is None


# ---------------------------------------------------------------- partial rollout

def test_partial_rollout_resumes_aborted_samples_with_offpolicy_mask(assets, engine):
    stops = " ".join(str(i) for i in range(60))
    cfg = make_config(assets, "--partial-rollout", "--mask-offpolicy-in-partial-rollout", "--rm-type", "random",
                      "--rollout-batch-size", "1", "--over-sampling-batch-size", "4", "--n-samples-per-prompt", "1",
                      "--rollout-max-response-len", "64", "--rollout-stop-token-ids", *stops.split())
    ctx = make_ctx(cfg, engine)
    partial = []
    for step in range(6):  # until a step stops while another sample is half-way (almost always the first)
        out = rollout(ctx, step)
        assert len(out.groups) == 1
        partial = [g for g in ctx.data_source.buffer if g[0].status == "aborted" and g[0].response_tokens]
        if partial:
            break
    assert partial, "no step aborted a running sample"
    assert out.metrics["rollout/aborted_samples"] >= 1
    s = partial[0][0]
    done, done_lp = list(s.response_tokens), list(s.response_logprobs)
    assert s.metadata["aborted_count"] == 1 and len(done_lp) == len(done)
    # the aborted sample continues from its partial response
    from relax.rollout.generate import SamplingSettings, generate_one
    import aiohttp

    async def resume():
        async with aiohttp.ClientSession() as session:
            return await generate_one(session, engine, s, SamplingSettings.from_config(cfg).to_sglang(),
                                      mask_offpolicy=True)

    asyncio.run(resume())
    assert s.response_tokens[:len(done)] == done and s.response_logprobs[:len(done)] == done_lp
    assert s.loss_mask[:len(done)] == [0] * len(done) and set(s.loss_mask[len(done):]) <= {1}
    assert len(s.response_tokens) <= 64 and s.status in ("completed", "truncated")
    assert s.metadata["resumed_tokens"] == len(done)
