"""The controller's start-up (relax.core.controller): TransferQueue's processes start in a thread while the trainer
ranks build their models, and a start-up that fails meanwhile (a trainer rank that cannot read its weights) still
stops the data plane that thread started, leaving nothing behind in the cluster for the next run."""

import json
import shutil

import pytest

from conftest import assert_ray_released, shared_ray, shared_tiny_model

from relax.config import parse_config
from relax.core.controller import Controller
from relax.core.deadlines import RoleFailure
from relax.data.plane import _controller_exists

pytestmark = pytest.mark.e2e  # Ray, a trainer rank, an engine (deselect with -m 'not e2e')


def test_a_trainer_that_fails_its_setup_while_the_data_plane_starts_leaves_no_data_plane(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(shared_tiny_model(), model)
    for weights in model.glob("*.safetensors"):  # found and named by the checks before a run, unreadable after
        weights.write_bytes(b"not a safetensors file")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i % 10)}) + "\n" for i in range(4)))
    config = parse_config(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--label-key", "label",
                           "--rm-type", "random", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                           "--num-rollout", "1", "--rollout-max-response-len", "3", "--micro-batch-size", "4",
                           "--distributed-backend", "gloo", "--output-dir", str(tmp_path / "out")])
    shared_ray()
    controller = Controller(config)
    with pytest.raises(RoleFailure) as failure:
        try:
            controller.start()
        finally:
            controller.shutdown()
    assert "trainer" in str(failure.value) and "setup" in str(failure.value), str(failure.value)
    assert controller.data is None  # the trainer failed before the run took the data plane over
    assert not _controller_exists(wait_dead_s=15.0)
    assert_ray_released()
