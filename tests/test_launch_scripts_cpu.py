"""The colocated launch script (examples/launch/run-grpo-colocate.sh), unchanged, runs two steps on CPU scaled
down by examples/launch/run-cpu.sh: the tiny model's flag file, tensor parallel 2 with sequence parallelism,
full recompute, dynamic batching, colocated engines, its own checkpoint folder as --load and --save."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.e2e  # a whole run in its own process: Ray, trainer, reference, engines


def test_colocate_launch_script_runs_scaled_down(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "examples" / "launch" / "run-cpu.sh"), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert "not supported yet" not in console
    assert "--sglang-mem-fraction-static: no effect with the embedded engine" in console  # a GPU-only knob
    assert "trainer: 2 rank(s), data-parallel 1" in console  # tensor parallel 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and all(r["samples/trained"] == 8 for r in records)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    config = (tmp_path / "run" / "resolved_config.yaml").read_text()
    assert "sequence_parallel: true" in config and "recompute_granularity: full" in config
