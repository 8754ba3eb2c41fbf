import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
os.environ.setdefault("TQ_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def relax_cli(*args: str, env: dict | None = None, timeout: float = 120):
    """Run `python -m relax.entrypoints.train ARGS` and return the CompletedProcess."""
    import subprocess

    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "relax.entrypoints.train", *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=str(ROOT))


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "1+1=", "label": "2"}\n{"input": "2+2=", "label": "4"}\n')
    return str(path)


def run_steps(config, after_start=None) -> list[dict]:
    """Start a Controller for `config`, run all its steps, shut it down (also on failure), and return the
    records of `<output-dir>/metrics.jsonl`. `after_start(controller)` runs between start and run."""
    import json

    from relax.core.controller import Controller

    controller = Controller(config)
    try:
        controller.start()
        if after_start is not None:
            after_start(controller)
        controller.run()
    finally:
        controller.shutdown()
    path = Path(config.output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
