"""A real run (Ray, Megatron on CPU, embedded engines) with --rm-type genrm and the tiny model as the judge on
engines of its own (evaluation after the step judges with it too): the judge requests reach the GenRM engines
and not the policy engine (the engines' `sglang:num_requests_total` counters), the parsed scores are the
samples' rewards, the step reports genrm/* metrics, and after the policy's weight push the GenRM engines still
serve --genrm-model-path (weight version and weights unchanged) while the policy engine serves version 1."""

import hashlib
import json

import pytest
import ray

from conftest import assert_ray_released, shared_ray

from relax.wire.auth import engine_api_key
from relax.wire.engine_client import EngineClient
from relax.config import parse_config
from relax.core.controller import Controller
from relax.observability.metrics_client import scrape_engine_metrics

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')

WEIGHTS = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight")


def parse_any(text):
    """--genrm-parser-path of the run: the tiny judge writes random text; any text maps to a score in [0, 1]."""
    return (sum(text.encode()) % 11) / 10.0


def _requests(url):
    metrics = scrape_engine_metrics(url, api_key=engine_api_key())
    return sum(v for k, v in metrics.items() if k.startswith("sglang:num_requests_total"))


def _state(url):
    client = EngineClient(url, timeout_s=30)
    try:
        digest = hashlib.sha256(json.dumps([client.get_weights_by_name(n, truncate_size=10**8) for n in WEIGHTS])
                                .encode()).hexdigest()
        return client.get_weight_version(), digest
    finally:
        client.close()


def test_genrm_judges_on_its_own_engines(tiny_model, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(2)))
    out = tmp_path / "run"
    cfg = parse_config([
        "--hf-checkpoint", tiny_model, "--prompt-data", str(data), "--label-key", "label",
        "--rm-type", "genrm", "--genrm-model-path", tiny_model, "--genrm-parser-path", "test_genrm_e2e.parse_any",
        "--genrm-sampling-config", '{"max_response_len": 8}', "--genrm-engine-config", '{"max_running_requests": 8}',
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--rollout-max-response-len", "8", "--micro-batch-size", "4", "--lr", "1e-3", "--lr-decay-style", "constant",
        "--distributed-backend", "gloo", "--resource", '{"actor": [1, 1], "rollout": [1, 1]}',
        # evaluation after the step judges with the same GenRM (its reward runner finds the manager's judge)
        "--eval-prompt-data", "held", str(data), "--eval-interval", "1", "--skip-eval-before-train",
        "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.jsonl"), "--output-dir", str(out)])
    shared_ray()
    controller = Controller(cfg)
    try:
        controller.start()
        rollout = controller.rollout
        policy = ray.get(rollout.get_engine_urls.remote())
        genrm = ray.get(rollout.genrm_engine_urls.remote())
        assert len(policy) == 1 and len(genrm) == 1 and not set(policy) & set(genrm)
        before = {url: _state(url) for url in genrm}
        assert all(version == "default" for version, _ in before.values())
        controller.run()
        judged = {url: _requests(url) for url in genrm}
        generated = {url: _requests(url) for url in policy}
        after = {url: _state(url) for url in genrm}
        policy_state = _state(policy[0])
        targets = ray.get(rollout.push_targets.remote())
    finally:
        controller.shutdown()
    assert_ray_released()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in records if "rollout/num_samples" in r][0]
    # one judgment per sample, on the GenRM engine only; the policy engine served the rollout's requests alone
    assert step["genrm/judgments"] == 4 and step["genrm/parse_failures"] == 0 and step["genrm/latency_mean"] > 0
    assert sum(judged.values()) == 4 + 2, judged  # and one per evaluation sample (2 prompts x 1)
    assert step["eval/held/reward_errors"] == 0 and step["eval/held/num_samples"] == 2
    assert 0 < sum(generated.values()) <= 4 + 2, generated  # the rollout's and the evaluation's requests
    # the parsed verdicts are the rewards
    rows = [json.loads(line) for line in (tmp_path / "rollout_0.jsonl").read_text().splitlines()[1:]]
    assert len(rows) == 4
    for row in rows:
        assert row["reward"] == parse_any(row["metadata"]["genrm_verdict"])
    # the policy's weights were pushed (version 1, weights changed); the GenRM's stayed as they were
    assert targets == policy
    assert policy_state[0] == "1" and policy_state[1] != before[genrm[0]][1]
    assert after == before
