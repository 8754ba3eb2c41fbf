"""Exact resume through the controller on CPU: 4 steps straight vs the same run resumed from its step-2
checkpoint (what a run killed after step 2 leaves) give identical rollouts, losses and final weights.

The rollouts repeat because every request carries a sampling seed derived from --rollout-seed, the step
and the sample (relax.rollout.generate), which the embedded engine honours whatever the batching."""

import pytest
import json
import shutil

import torch

from conftest import shared_ray, shared_tiny_model

from relax.config import parse_config
from relax.core.controller import Controller
from relax.models.tasks import generate_task_dataset

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')


def _run(args):
    shared_ray()
    controller = Controller(parse_config(args))
    try:
        controller.start()
        controller.run()
    finally:
        controller.shutdown()


def _metrics(out):
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _rollout(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    return [(r["prompt_tokens"], r["response_tokens"], r["reward"]) for r in rows]


def test_resume_is_exact(tmp_path):
    model = str(shared_tiny_model())
    data = str(generate_task_dataset(tmp_path / "train.jsonl", 20, seed=0, task="add_mod10"))

    def args(name, *extra):
        out = tmp_path / name
        return [
            "--hf-checkpoint", model, "--prompt-data", data, "--apply-chat-template", "--input-key", "input",
            "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "2", "--n-samples-per-prompt",
            "4", "--num-rollout", "4", "--rollout-max-response-len", "4", "--rollout-shuffle",
            "--micro-batch-size", "4", "--lr", "1e-2", "--lr-decay-style", "cosine", "--resource",
            '{"actor": [1, 1], "rollout": [1, 1]}', "--num-data-storage-units", "1", "--output-dir", str(out),
            "--save", str(out / "ckpt"), "--distributed-backend", "gloo",
            "--save-debug-rollout-data", str(out / "rollouts" / "{rollout_id}.jsonl"), *extra,
        ]

    _run(args("straight", "--save-interval", "2"))
    straight = tmp_path / "straight"
    # what a run killed after its step-2 checkpoint leaves behind
    half = tmp_path / "half_ckpt"
    half.mkdir()
    shutil.copytree(straight / "ckpt" / "iter_0000002", half / "iter_0000002")
    (half / "latest_checkpointed_iteration.txt").write_text("2")

    _run(args("resumed", "--load", str(half)))
    resumed = tmp_path / "resumed"

    a, b = _metrics(straight), _metrics(resumed)
    assert sorted(b) == [2, 3]
    for step in (2, 3):
        assert _rollout(straight / "rollouts" / f"{step}.jsonl") == _rollout(resumed / "rollouts" / f"{step}.jsonl")
        for key in ("train/loss", "train/grad_norm", "train/lr", "rollout/reward_mean", "rollout/response_len_mean"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
    assert a[3]["train/grad_norm"] > 0
    # the same final weights and optimizer state, bit for bit
    sa = torch.load(straight / "ckpt" / "iter_0000004" / "actor" / "rank00000.pt", weights_only=False)
    sb = torch.load(resumed / "ckpt" / "iter_0000004" / "actor" / "rank00000.pt", weights_only=False)
    for name, tensor in sa["model"].items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, sb["model"][name]), name
    for pa, pb in zip(sa["optimizer"][0]["main_params"], sb["optimizer"][0]["main_params"]):
        assert torch.equal(pa, pb)
    ia, ib = sa["optimizer"][0]["inner"]["state"], sb["optimizer"][0]["inner"]["state"]
    assert ia.keys() == ib.keys()
    for k in ia:
        for field in ia[k]:
            assert torch.equal(torch.as_tensor(ia[k][field]), torch.as_tensor(ib[k][field])), (k, field)
