"""The GenRM judge without Ray: the default parser on known judge texts, the default template through the GenRM
model's chat template, custom template and parser by dotted path, and unparseable verdicts under
--reward-error-policy (a small HTTP server stands in for the GenRM router); the flags' checks before Ray."""

import asyncio
import json

import aiohttp.web
import pytest
from transformers import AutoTokenizer

from relax.config import parse_config
from relax.config.errors import ConfigError
from relax.data.sample import Sample
from relax.config.genrm_options import DEFAULT_SAMPLING, engine_config, sampling_config
from relax.roles.genrm import genrm_num_engines
from relax.rollout.rewards import RewardError, RewardRunner
from relax.rollout.rewards.genrm import (GenRMJudge, GenRMParseError, default_parser, default_template,
                                         load_genrm_hook)


@pytest.mark.parametrize("text,score", [
    ("The response is right.\n\\boxed{1}", 1.0),
    ("It misses the units. \\boxed{0.5}", 0.5),
    ("first \\boxed{1} then reconsidered: \\boxed{0}", 0.0),
    ("\\boxed{3/4}", 0.75),
    ("Score: \\boxed{ Yes }", 1.0),
    ("\\boxed{\\text{incorrect}}", 0.0),
    ("Looks fine to me.\n\nVerdict: Yes", 1.0),
    ("**No**.", 0.0),
    ("Final answer: no", 0.0),
])
def test_default_parser_reads_known_judge_texts(text, score):
    assert default_parser(text) == score


@pytest.mark.parametrize("text", ["", "I think it is probably fine", "\\boxed{maybe}", "no idea what to say here",
                                  "yes, but \\boxed{}"])
def test_default_parser_refuses_texts_without_a_score(text):
    with pytest.raises(GenRMParseError):
        default_parser(text)


def test_default_template_holds_question_reference_and_response():
    messages = default_template("What is 2+2?", "4", "4", {})
    assert [m["role"] for m in messages] == ["system", "user"]
    user = messages[1]["content"]
    assert "Question:\nWhat is 2+2?" in user and "Reference answer:\n4" in user and "Response:\n4" in user
    assert "\\boxed{score}" in user
    no_label = default_template([{"role": "user", "content": "hi"}], "hello")[1]["content"]
    assert "Reference answer" not in no_label and "user: hi" in no_label


# --- hooks named by dotted path (this module's functions)
def judge_template(prompt, response, label, metadata):
    return f"JUDGE {prompt} || {response} || {label}"


def judge_parser(text):
    """Any text to a score in [0, 1], deterministically; None (unparseable) for a text starting with '?'."""
    if text.startswith("?"):
        return None
    return (sum(text.encode()) % 11) / 10.0


class FakeJudge:
    """A GenRM router stand-in: answers /generate with the next verdict and records the requests."""

    def __init__(self, verdicts):
        self.verdicts = list(verdicts)
        self.requests = []

    async def generate(self, request):
        body = await request.json()
        self.requests.append(body)
        text = self.verdicts[(len(self.requests) - 1) % len(self.verdicts)]
        return aiohttp.web.json_response({"text": text, "meta_info": {"finish_reason": {"type": "stop"},
                                                                     "output_token_logprobs": []}})

    async def serve(self, fn):
        app = aiohttp.web.Application()
        app.router.add_post("/generate", self.generate)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await fn(f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()


def _samples(n):
    return [Sample(group_index=0, prompt=f"q{i}", response_text=f"r{i}", label=str(i), metadata={}) for i in range(n)]


def test_custom_template_and_parser_by_dotted_path(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    template = load_genrm_hook("test_genrm.judge_template", "--genrm-template-path", default_template)
    parser = load_genrm_hook("test_genrm.judge_parser", "--genrm-parser-path", default_parser)
    fake = FakeJudge(["looks good", "bad answer"])

    async def run(url):
        judge = GenRMJudge(url, tok, sampling={"max_response_len": 16}, template=template, parser=parser)
        runner = RewardRunner("genrm")
        runner.genrm = judge
        samples = _samples(2)
        result = await runner.ascore(samples, assign=True)
        return judge, samples, result

    judge, samples, result = asyncio.run(fake.serve(run))
    assert result.rewards == [judge_parser("looks good"), judge_parser("bad answer")]
    assert [s.reward for s in samples] == result.rewards
    assert samples[0].metadata["genrm_verdict"] == "looks good"
    # the string template is the judge prompt as is (no chat template); the sampling defaults fill in
    assert fake.requests[0]["input_ids"] == tok.encode("JUDGE q0 || r0 || 0", add_special_tokens=False)
    assert fake.requests[0]["sampling_params"] == {"temperature": 0.1, "top_p": 1.0, "top_k": -1, "max_new_tokens": 16}
    metrics = judge.take_metrics()
    assert metrics["genrm/judgments"] == 2 and metrics["genrm/parse_failures"] == 0 and metrics["genrm/latency_mean"] > 0
    with pytest.raises(ValueError, match="--genrm-parser-path"):
        load_genrm_hook("test_genrm.nothing_here", "--genrm-parser-path", default_parser)


def test_metadata_rm_type_genrm_is_judged_beside_other_rewards(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    fake = FakeJudge(["Verdict: Yes"])

    async def run(url):
        runner = RewardRunner("exact_match")
        runner.genrm = GenRMJudge(url, tok)
        samples = _samples(2)
        samples[0].metadata["rm_type"] = "genrm"  # judged; the other one by exact match ("r1" != "1")
        return await runner.ascore(samples, assign=True)

    result = asyncio.run(fake.serve(run))
    assert result.rewards == [1.0, 0.0] and len(fake.requests) == 1


def test_default_template_goes_through_the_genrm_chat_template(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    judge = GenRMJudge("http://unused", tok)
    ids = judge.request_ids(_samples(1)[0])
    text = tok.decode(ids)
    assert text == tok.apply_chat_template(default_template("q0", "r0", "0", {}), tokenize=False,
                                           add_generation_prompt=True)


@pytest.mark.parametrize("policy", ["zero", "fail"])
def test_unparseable_verdicts_follow_the_reward_error_policy(tiny_model, policy):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    fake = FakeJudge(["Correct.\n\\boxed{1}", "I am not sure.", "Verdict: No"])

    async def run(url):
        judge = GenRMJudge(url, tok)  # the default template and parser
        runner = RewardRunner("genrm", on_error=policy)
        runner.genrm = judge
        samples = _samples(3)
        try:
            return judge, samples, await runner.ascore(samples, assign=True)
        except RewardError as exc:
            return judge, samples, exc

    judge, samples, result = asyncio.run(fake.serve(run))
    if policy == "fail":
        assert isinstance(result, RewardError)
        assert "GenRM verdict could not be parsed" in str(result) and "reward genrm" in str(result)
        return
    assert result.rewards == [1.0, 0.0, 0.0] and result.num_errors == 1 and result.error_indices == [1]
    assert "GenRM verdict could not be parsed" in samples[1].metadata["reward_error"]
    assert "reward_error" not in samples[2].metadata  # a parsed 0 is a score, not a failure
    metrics = judge.take_metrics()
    assert metrics["genrm/parse_failures"] == 1 and metrics["genrm/judgments"] == 3
    assert judge.take_metrics()["genrm/judgments"] == 0  # per step: taken once


def test_default_template_needs_a_chat_template():
    class PlainTokenizer:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template.*--genrm-template-path"):
        GenRMJudge("http://unused", PlainTokenizer())
    GenRMJudge("http://unused", PlainTokenizer(), template=judge_template)  # a string template needs none


def test_genrm_type_without_engines_is_a_reward_failure():
    runner = RewardRunner("genrm", on_error="zero")
    result = runner.score(_samples(1))
    assert result.num_errors == 1


# --- flags, checked before Ray
def test_sampling_and_engine_config_checks():
    assert sampling_config(None) == DEFAULT_SAMPLING
    assert sampling_config({"temperature": 0, "max_response_len": 8})["temperature"] == 0.0
    for bad, words in [({"temp": 1}, "unknown key"), ({"top_p": 0}, "top_p"), ({"top_k": 0}, "top_k"),
                       ({"max_response_len": "8"}, "max_response_len"), ({"temperature": True}, "temperature")]:
        with pytest.raises(ConfigError, match=f"--genrm-sampling-config.*{words}"):
            sampling_config(bad)
    assert engine_config({"max_running_requests": 8, "dp_size": 2}, "embedded") == ({"max_running_requests": 8},
                                                                                  ["dp_size"])
    for bad, words in [({"foo": 1}, "unknown key 'foo'"), ({"tp_size": 2}, "--genrm-num-gpus-per-engine"),
                       ({"model_path": "x"}, "--genrm-model-path"), ({"context_length": "8"}, "type int")]:
        with pytest.raises(ConfigError, match=f"--genrm-engine-config.*{words}"):
            engine_config(bad, "embedded")


@pytest.mark.parametrize("extra,words", [
    (["--genrm-sampling-config", '{"temperature": 0.5}'], "add --genrm-model-path"),
    (["--rm-type", "genrm"], "add --genrm-model-path"),
    (["--genrm-model-path", "m", "--rm-type", "genrm", "--group-rm"], "no listwise template"),
    (["--genrm-model-path", "m", "--genrm-sampling-config", '{"top_k": 0.5}'], "--genrm-sampling-config: top_k"),
    (["--genrm-model-path", "m", "--genrm-engine-config", '{"foo": 1}'], "--genrm-engine-config: unknown key"),
    (["--genrm-model-path", "m", "--genrm-parser-path", "nope.mod.fn"], "--genrm-parser-path: cannot import"),
    (["--genrm-model-path", "m", "--genrm-num-gpus", "3", "--genrm-num-gpus-per-engine", "2"], "multiple"),
])
def test_genrm_flags_are_checked_before_ray(tiny_model, extra, words):
    with pytest.raises(ConfigError, match=words):
        parse_config(["--hf-checkpoint", tiny_model, "--dry-run", *extra])


def test_genrm_engine_count(tiny_model):
    cfg = parse_config(["--hf-checkpoint", tiny_model, "--dry-run", "--genrm-model-path", tiny_model,
                        "--genrm-num-gpus", "4", "--genrm-num-gpus-per-engine", "2"])
    assert genrm_num_engines(cfg) == 2


def test_genrm_flags_parse(tiny_model):
    cfg = parse_config(["--hf-checkpoint", tiny_model, "--dry-run", "--genrm-model-path", tiny_model, "--rm-type",
                        "genrm", "--genrm-sampling-config", json.dumps({"max_response_len": 32}),
                        "--genrm-parser-path", "test_genrm.judge_parser"])
    assert cfg.genrm_sampling_config == {"max_response_len": 32} and cfg.rm_type == "genrm"
