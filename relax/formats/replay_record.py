"""What a saved rollout needs to be replayed, recorded in the header of its debug file.

`--save-debug-rollout-data` writes the run's model and batch shape into the file's header line
(`{"relax_debug_rollout": 1, ..., "run": {...}}`), so that `relax-train --load-debug-rollout-data FILE`
needs no other flag: validation fills the recorded values in, and a flag given explicitly with a different
value is an error naming both values (training on another model or batch shape than the one that
generated the samples would silently change what is trained).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

HEADER_KEY = "relax_debug_rollout"
RECORDED_FLAGS = ("hf_checkpoint", "rollout_batch_size", "n_samples_per_prompt")


def run_record(config: Any) -> dict[str, Any]:
    """The values of `RECORDED_FLAGS` in a run's config."""
    return {name: getattr(config, name) for name in RECORDED_FLAGS}


def first_file(template: str, rollout_id: int = 0) -> Path:
    return Path(template.format(rollout_id=rollout_id) if "{rollout_id}" in template else template)


def read_header(path: str | Path) -> dict[str, Any]:
    """The header line of a debug rollout file; ValueError naming the file when it is not one."""
    with open(path, encoding="utf-8") as fh:
        line = fh.readline()
    try:
        header = json.loads(line)
    except ValueError:
        header = None
    if not isinstance(header, dict) or HEADER_KEY not in header:
        raise ValueError(f"{path}: not a Relax debug rollout file (its first line is no header)")
    return header


def recorded_run(template: str, rollout_id: int = 0) -> Optional[Mapping[str, Any]]:
    """The run record of a replay file, None when the file predates records (or is missing)."""
    path = first_file(template, rollout_id)
    if not path.is_file():
        return None
    return read_header(path).get("run")
