"""`--save-debug-rollout-data` / `--load-debug-rollout-data`: one step's samples as JSON lines.

The file (its path may contain `{rollout_id}`) holds a header line
`{"relax_debug_rollout": 1, "rollout_id": N, "num_samples": M, "run": {...}}` (`run`: what a replay needs,
`relax.formats.replay_record`) and then one `Sample.to_dict()` per
line. JSON only: loading never unpickles anything, and floats (log-probs, rewards) round-trip exactly.
A sample whose prompt/label/metadata is not JSON-serializable fails the save, naming the field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from relax.formats.replay_record import HEADER_KEY
from relax.data.sample import SAMPLE_FIELDS, Sample

FORMAT_VERSION = 1


def debug_path(template: str, rollout_id: int) -> str:
    return template.format(rollout_id=rollout_id) if "{rollout_id}" in template else template


def save_rollout_data(template: str, rollout_id: int, samples: Sequence[Sample],
                      run: Optional[dict] = None) -> str:
    """Write one step's samples; `run` (`relax.formats.replay_record.run_record`) lets a replay run without flags."""
    path = Path(debug_path(template, rollout_id))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        header = {HEADER_KEY: FORMAT_VERSION, "rollout_id": rollout_id, "num_samples": len(samples)}
        if run is not None:
            header["run"] = run
        fh.write(json.dumps(header) + "\n")
        for s in samples:
            row = s.to_dict()
            try:
                line = json.dumps(row, allow_nan=True)
            except (TypeError, ValueError):
                for name in SAMPLE_FIELDS:
                    try:
                        json.dumps(row[name])
                    except (TypeError, ValueError) as exc:
                        raise TypeError(f"--save-debug-rollout-data: sample {s.index} field {name!r} is not "
                                        f"JSON-serializable ({exc})") from None
                raise
            fh.write(line + "\n")
    os.replace(tmp, path)
    return str(path)


def load_rollout_data(template: str, rollout_id: int, subsample: Optional[float] = None,
                      seed: int = 0) -> list[Sample]:
    """The saved samples of a step (whole prompt groups when subsampled), re-stamped with `rollout_id`."""
    path = debug_path(template, rollout_id)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--load-debug-rollout-data: no saved rollout data for step {rollout_id}: {path}")
    with open(path, encoding="utf-8") as fh:
        header = json.loads(fh.readline())
        if not isinstance(header, dict) or header.get("relax_debug_rollout") != FORMAT_VERSION:
            raise ValueError(f"{path}: not a Relax debug rollout file (format {FORMAT_VERSION})")
        samples = []
        for lineno, line in enumerate(fh, start=2):
            if line.strip():
                try:
                    samples.append(Sample.from_dict(json.loads(line)))
                except (ValueError, TypeError) as exc:
                    raise ValueError(f"{path}:{lineno}: {exc}") from None
    if len(samples) != header.get("num_samples"):
        raise ValueError(f"{path}: header says {header.get('num_samples')} samples, file has {len(samples)} "
                         "(truncated file?)")
    if subsample is not None and subsample < 1.0:
        groups = sorted({s.group_index for s in samples})
        keep_n = max(1, int(round(len(groups) * subsample)))
        rng = np.random.default_rng([seed, rollout_id])
        keep = {groups[i] for i in rng.choice(len(groups), size=keep_n, replace=False)}
        samples = [s for s in samples if s.group_index in keep]
    for s in samples:
        s.rollout_step = rollout_id
    return samples
