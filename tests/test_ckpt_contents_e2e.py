"""Megatron's checkpoint and run-control flags through one whole run on CPU (tiny model, one trainer rank,
embedded engine): the actor starts from --pretrained-checkpoint's weights (--load holds no checkpoint yet), skips
one step's update (--iterations-to-skip), rotates its checkpoints around --save-retain-interval and stops at
--exit-duration-in-mins with a checkpoint. Which iteration --ckpt-step / --finetune load and what they restore are
unit-tested with the other logic in tests/test_ckpt_contents.py."""

from __future__ import annotations

import shutil

import pytest
import ray
from safetensors.torch import load_file, save_file

from conftest import run_steps, shared_tiny_model

from relax.formats import checkpoint_layout as layout
from relax.config import parse_config
from relax.models.tasks import generate_task_dataset

pytestmark = pytest.mark.e2e  # whole runs: Ray, trainer, engines (deselect with -m 'not e2e')


def _args(tmp_path, data, *extra):
    return ["--hf-checkpoint", str(shared_tiny_model()), "--prompt-data", data, "--apply-chat-template",
            "--input-key", "input", "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "2", "--micro-batch-size", "4", "--lr",
            "1e-2", "--resource", '{"actor": [1, 1], "rollout": [1, 1]}', "--num-data-storage-units", "1",
            "--output-dir", str(tmp_path / "out"), "--distributed-backend", "gloo", *extra]


def _doubled_model(folder):
    """A copy of the tiny model with every weight doubled (a pretrained checkpoint the run can be told from), and
    the sum of |w| over its weights (the trainer's fused matrices hold the same numbers)."""
    shutil.copytree(shared_tiny_model(), folder)
    total = 0.0
    for file in folder.glob("*.safetensors"):
        doubled = {k: (2 * v).contiguous() for k, v in load_file(file).items()}
        save_file(doubled, str(file), metadata={"format": "pt"})
        total += sum(float(t.double().abs().sum()) for t in doubled.values())
    return folder, total


def test_pretrained_skip_retain_and_exit_duration_in_one_run(tmp_path):
    data = str(generate_task_dataset(tmp_path / "train.jsonl", 20, seed=0, task="add_mod10"))
    save = tmp_path / "ckpt"
    pretrained, expected = _doubled_model(tmp_path / "pre")
    config = parse_config(_args(tmp_path, data, "--num-rollout", "6", "--load", str(save), "--save", str(save),
                                "--pretrained-checkpoint", str(pretrained), "--save-interval", "1", "--max-actor-ckpt-to-keep", "1",
                                "--save-retain-interval", "2", "--iterations-to-skip", "2",
                                "--exit-duration-in-mins", "1"))
    ends = iter([0.0, 0.0, 61.0])  # the clock at the end of steps 0, 1, 2: past the minute after step 2
    seen = {}

    def started(controller):
        rc = controller.run_control
        rc.clock = lambda: rc.started + next(ends)
        seen["start"], seen["controller"] = controller.start_step, controller
        seen["actor"] = ray.get(controller.workers[0].weights_checksum.remote())

    records = run_steps(config, after_start=started)
    assert seen["start"] == 0 and seen["actor"] == pytest.approx(expected, rel=1e-6)
    assert [r["step"] for r in records] == [0, 1, 2]  # stopped early, cleanly, saying why and where
    assert seen["controller"].run_control.stopped == (
        f"stopping after step 2 (3 of 6 steps done): --exit-duration-in-mins 1: 1.0 min since the run started; "
        f"checkpoint 3 saved in {save} (resume with --load {save})")
    assert records[1]["train/skipped_iteration"] == 1.0 and "train/loss" not in records[1]
    assert records[1]["rollout/num_samples"] == 4  # the skipped step was still rolled out
    assert all("train/loss" in records[s] for s in (0, 2))
    # saved after every step; the rotation kept the last one and the multiple of 2
    assert [i for i, _ in layout.iterations(save)] == [2, 3] and layout.latest_iteration(save) == 3
    assert layout.read_meta(layout.iter_dir(save, 3) / "actor")["iteration"] == 2  # two updates: step 1 skipped
