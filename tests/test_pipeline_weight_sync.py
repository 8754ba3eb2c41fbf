"""Weight sync from a pipeline-parallel trainer (2 stages over gloo, real Ray, an embedded engine): the engine
must receive every stage's layers, not only the first stage's; --check-weight-update-equal reads each
pushed tensor back from the engine."""

import pytest
import json

from conftest import run_steps
from safetensors import safe_open

from relax.config import parse_config
from relax.models.tiny import TinyArch, build_tiny_model_dir

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')


def test_engine_gets_the_weights_of_every_pipeline_stage(tmp_path):
    arch = TinyArch(family="qwen2")
    model = build_tiny_model_dir(tmp_path / "model", arch, seed=0)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i % 10)}) + "\n" for i in range(4)))
    config = parse_config([
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--apply-chat-template", "--label-key", "label",
        "--rm-type", "random", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--rollout-max-response-len", "3", "--micro-batch-size", "1", "--lr", "1e-3", "--lr-decay-style", "constant",
        "--pipeline-model-parallel-size", "2", "--resource", '{"actor": [1, 2], "rollout": [1, 1]}',
        "--check-weight-update-equal", "--distributed-backend", "gloo", "--output-dir", str(tmp_path / "run")])
    records = run_steps(config)
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        total = sum(f.get_tensor(n).numel() * 4 for n in names)  # float32 on CPU
    assert any(".layers.1." in n for n in names)  # a layer the second stage owns
    assert records[-1]["weights/version"] == 1.0
    assert records[-1]["perf/weight_sync_bytes"] == total
