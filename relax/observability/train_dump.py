"""`--save-debug-train-data`: what one trainer rank trained on in one rollout step, for post-hoc analysis.

The file (path template with `{rollout_id}` and optionally `{rank}`; without `{rank}` only rank 0 writes)
holds a plain dict written by `torch.save`: `{"relax_debug_train": 1, "rollout_id": N, "rank": R,
"samples": [row, ...]}` where each row has the sample's `index`, `tokens`, `response_length`, `loss_mask`,
`advantages` and, when the step computed them, `old_logprobs`, `ref_logprobs`, `rollout_logprobs`,
`returns`. Only tensors, numbers and strings: `load_train_data` reads it with `weights_only=True`, so loading
never unpickles arbitrary objects. Writes are atomic (temporary file, then rename).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

FORMAT_VERSION = 1
ROW_KEYS = ("tokens", "response_length", "loss_mask", "advantages", "old_logprobs", "ref_logprobs",
            "rollout_logprobs", "returns")


def train_data_path(template: str, rollout_id: int, rank: int) -> Optional[str]:
    """Where `rank` writes step `rollout_id`, or None when this rank does not write (no `{rank}`, rank > 0)."""
    if "{rank}" not in template and rank != 0:
        return None
    return template.replace("{rollout_id}", str(rollout_id)).replace("{rank}", str(rank))


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return torch.tensor(value)
    raise TypeError(f"--save-debug-train-data: cannot store a {type(value).__name__}")


def save_train_data(template: str, rollout_id: int, rank: int, inputs: Sequence[dict[str, Any]],
                    sample_indices: Sequence[int]) -> Optional[str]:
    """Write this rank's copy of the step's trainer inputs (one dict per sample, as built by
    `relax.training.advantages.trainer_inputs` plus old/reference log-probs); returns the path written."""
    path = train_data_path(template, rollout_id, rank)
    if path is None:
        return None
    rows = []
    for index, x in zip(sample_indices, inputs):
        row = {"index": int(index)}
        for key in ROW_KEYS:
            if x.get(key) is not None:
                row[key] = _plain(x[key])
        rows.append(row)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    torch.save({"relax_debug_train": FORMAT_VERSION, "rollout_id": int(rollout_id), "rank": int(rank),
                "samples": rows}, tmp)
    os.replace(tmp, target)
    return str(target)


def load_train_data(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no saved train data: {path}")
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or data.get("relax_debug_train") != FORMAT_VERSION:
        raise ValueError(f"{path}: not a Relax debug train-data file (format {FORMAT_VERSION})")
    return data
