"""Fixtures and helpers of the whole-run tests (Ray, trainer, engines through the controller). Registered for every
test by tests/conftest.py (`pytest_plugins`)."""

import json

import pytest


@pytest.fixture(scope="module")
def assets(request, tmp_path_factory):
    """(folder, model, data) for the module's runs: a fresh folder, the session's tiny model and 40 prompts of the
    add_mod10 task (seed 0). A module whose runs need other data defines its own `assets`."""
    from conftest import shared_tiny_model
    from relax.models.tasks import generate_task_dataset

    base = tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_"))
    data = generate_task_dataset(base / "train.jsonl", 40, seed=0, task="add_mod10")
    return base, str(shared_tiny_model()), str(data)


def train_argv(model, data, out, *extra, actor_ranks=2):
    """A small GRPO run's flags: 2 prompts x 4 samples a step, responses of 4 tokens, random rewards, `actor_ranks`
    data-parallel trainer ranks over gloo and one engine; the output in `out`."""
    return ["--hf-checkpoint", model, "--prompt-data", data, "--apply-chat-template", "--input-key", "input",
            "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "4", "--micro-batch-size", "4", "--lr", "1e-2",
            "--resource", json.dumps({"actor": [1, actor_ranks], "rollout": [1, 1]}), "--num-data-storage-units", "1",
            "--output-dir", str(out), "--distributed-backend", "gloo", *extra]


def read_records(out):
    """The run's metrics records (`<out>/metrics.jsonl`)."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
