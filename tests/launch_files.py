"""The model flag files of examples/launch/models/, as the family and flag-file tests read them."""

from __future__ import annotations

import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def model_args(name: str) -> list[str]:
    """MODEL_ARGS of examples/launch/models/<name>, as bash splits them."""
    text = (ROOT / "examples" / "launch" / "models" / name).read_text()
    body = text[text.index("MODEL_ARGS=(") + len("MODEL_ARGS=("):]
    return shlex.split(body[:body.index(")")], comments=True)


def flag_run(model, prompt_file, tmp_path, *flags) -> list[str]:
    """A two-step run's command line of `model` on `prompt_file` with a flag file's `flags`."""
    return ["--hf-checkpoint", str(model), "--prompt-data", prompt_file, "--rollout-batch-size", "2",
            "--num-rollout", "2", "--output-dir", str(tmp_path / "out"), *flags]
