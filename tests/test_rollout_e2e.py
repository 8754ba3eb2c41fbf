"""Through the controller (Ray, Megatron on CPU, an embedded engine behind sglang-router): over-sampling
with a dynamic filter, evaluation before and during training, the rollout hooks, and the debug modes:
saved rollout data replayed without engines reproduces the training step (same samples -> same loss);
--debug-rollout-only generates without training."""

import json

import pytest
import ray

from conftest import shared_ray, shared_tiny_model

from relax.config import parse_config
from relax.core.controller import Controller

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')

LOGGED = {}


def keep_even(args, group):
    return (group[0].metadata["prompt_index"] % 2 == 0, "odd_prompt")


def mark(args, samples):
    for s in samples:
        s.metadata["postprocessed"] = True


def log_fn(args, rollout_id, samples, metrics):
    return {"custom/num_samples": float(len(samples)), "custom/saw_filter_metric":
            float("rollout/filtered_groups" in metrics)}


def eval_log_fn(args, rollout_id, data, metrics):
    return {"custom/eval_sets": float(len(data))}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("rollout_e2e")
    model = shared_tiny_model()
    data = base / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i % 10)}) + "\n" for i in range(8)))
    evald = base / "eval.jsonl"
    evald.write_text("".join(json.dumps({"input": f"{i}*2=", "label": str(2 * i % 10)}) + "\n" for i in range(2)))
    return base, str(model), str(data), str(evald)


def run(config):
    shared_ray()
    controller = Controller(config)
    try:
        controller.start()
        before = ray.get(controller.workers[0].weights_checksum.remote())
        controller.run()
        after = ray.get(controller.workers[0].weights_checksum.remote())
    finally:
        controller.shutdown()
    records = [json.loads(x) for x in (__import__("pathlib").Path(config.output_dir) / "metrics.jsonl")
               .read_text().splitlines()]
    return records, before, after


def common(assets, out):
    base, model, data, evald = assets
    return ["--hf-checkpoint", model, "--apply-chat-template", "--label-key", "label", "--rm-type", "random",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--rollout-max-response-len", "3", "--micro-batch-size", "4", "--lr", "1e-3",
            "--lr-decay-style", "constant", "--resource", '{"actor": [1, 1], "rollout": [1, 1]}',
            "--distributed-backend", "gloo", "--output-dir", str(base / out)]


def test_save_then_replay_reproduces_the_step_and_rollout_only(assets, monkeypatch):
    import os
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)  # Ray workers import the hooks below from this module
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    base, model, data, evald = assets
    saved = str(base / "debug" / "rollout_{rollout_id}.jsonl")
    m = __name__
    a = parse_config(common(assets, "a") + [
        "--prompt-data", data, "--over-sampling-batch-size", "3",
        "--dynamic-sampling-filter-path", f"{m}.keep_even", "--rollout-data-postprocess-path", f"{m}.mark",
        "--custom-rollout-log-function-path", f"{m}.log_fn", "--custom-eval-rollout-log-function-path",
        f"{m}.eval_log_fn", "--eval-prompt-data", "tiny", evald, "--eval-interval", "1",
        "--n-samples-per-eval-prompt", "2", "--log-passrate", "--save-debug-rollout-data", saved])
    records, before, after = run(a)
    assert after != before
    pre, step = records[0], records[-1]
    assert pre["eval/before_train"] == 1.0 and pre["eval/tiny/num_samples"] == 4.0 and "eval/tiny/pass@2" in pre
    assert step["eval/tiny/num_samples"] == 4.0 and step["custom/eval_sets"] == 1.0
    assert step["rollout/num_samples"] == 4.0 and step["data/step_samples"] == 4.0
    # The odd prompt's group is filtered, or, when the two even groups finish first (request timing), returned
    # unfinished to the data source; either way it is accounted for and never trained.
    assert step.get("rollout/filtered_groups/odd_prompt", 0) + step["rollout/returned_groups"] >= 1, step
    assert step["custom/saw_filter_metric"] == 1.0
    assert step["custom/num_samples"] == 4.0 and "rollout/pass@2" in step
    rows = [json.loads(x) for x in open(saved.format(rollout_id=0))]
    assert rows[0]["num_samples"] == 4 and all(r["metadata"]["postprocessed"] for r in rows[1:])
    assert all(r["metadata"]["prompt_index"] % 2 == 0 for r in rows[1:])

    # replay: no prompts, no engines; the same samples give the same loss and gradient
    b = parse_config(common(assets, "b") + ["--load-debug-rollout-data", saved])
    assert b.debug_train_only
    records_b, before_b, after_b = run(b)
    assert before_b == before
    rb = records_b[-1]
    assert rb["rollout/num_samples"] == 4.0
    assert rb["train/loss"] == pytest.approx(step["train/loss"], rel=1e-6, abs=1e-7)
    assert rb["train/grad_norm"] == pytest.approx(step["train/grad_norm"], rel=1e-6)
    assert after_b == pytest.approx(after, rel=1e-9)

    # rollout only: samples are generated and counted, nothing is trained
    c = parse_config(common(assets, "c") + ["--prompt-data", data, "--debug-rollout-only"])
    records_c, before_c, after_c = run(c)
    assert after_c == before_c
    assert records_c[-1]["rollout/num_samples"] == 4.0 and not any(k.startswith("train/") for k in records_c[-1])
