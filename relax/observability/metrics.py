"""Per-step metrics: one JSON object per rollout step in metrics.jsonl, stdout, and TensorBoard."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Mapping

_STDOUT_KEYS = ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/grad_norm",
                "train/entropy", "perf/step_time", "perf/tokens_per_s")


class MetricsWriter:
    def __init__(self, output_dir: str, *, tensorboard_dir: str | None = None, experiment: str | None = None,
                 stream=sys.stdout):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._stream = stream
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(tensorboard_dir, experiment or "relax"))

    @classmethod
    def from_config(cls, config: Any) -> "MetricsWriter":
        tb_dir = None
        if config.use_tensorboard:
            tb_dir = config.tb_project_name or os.environ.get("TENSORBOARD_DIR") or os.path.join(
                config.output_dir, "tensorboard")
        return cls(config.output_dir, tensorboard_dir=tb_dir, experiment=config.tb_experiment_name)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        shown = " ".join(f"{k.split('/')[-1]}={record[k]:.4g}" for k in _STDOUT_KEYS if isinstance(record.get(k), float))
        print(f"[relax] step {step}: {shown}", file=self._stream, flush=True)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value
    return str(value)
