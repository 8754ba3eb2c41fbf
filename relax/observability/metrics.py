"""Per-step metrics: one JSON object per rollout step in metrics.jsonl, stdout, TensorBoard and ClearML.

metrics.jsonl keeps every value as logged (a list-valued metric stays a list). TensorBoard and ClearML take
scalars only: there a list `key` becomes `key/mean`, `key/p50`, `key/p90` and `key/max` (`scalars`).
`--use-clearml` reports to a ClearML task (relax/observability/clearml_sink.py).

`CollapseMonitor` reads each step's metrics and warns (logger `relax.collapse`: console and logs/relax.log),
naming the step, when training has lost its signal:

* every group has zero reward variance: `rollout/zero_std_group_fraction` == 1 when the rollout reports it
  (`relax.rollout.step_logs.group_variance_metrics`), else `rollout/reward_std` == 0 with groups of more
  than one sample (every sample scored the same, so every group did). GRPO-style advantages are then all 0
  and only the KL term moves the policy; on the embedded default this was the signature of a collapse onto
  the bare stop token (reward exactly 0 for 25 steps).
* `train/entropy` (nats per response token) below `ENTROPY_FLOOR` while `rollout/reward_mean` is below
  `SOLVED_REWARD`: the policy answers (nearly) deterministically without solving the task, so groups stop
  differing. A solved task legitimately gets there (the embedded default ends near entropy 0.03 at reward
  0.99), so it is not flagged then.

A warning is given on the first step of such a streak and every `repeat_every` steps while it lasts; its end
is logged too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from relax.observability.console import clear_progress

collapse_log = logging.getLogger("relax.collapse")
ENTROPY_FLOOR = 0.05  # nats per token; the collapsed embedded default sat at 0.04 (reward 0)
SOLVED_REWARD = 0.9  # at or above this mean reward a low entropy is convergence, not collapse

_STDOUT_KEYS = ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/grad_norm",
                "train/entropy", "perf/step_time", "perf/tokens_per_s")


class MetricsWriter:
    def __init__(self, output_dir: str, *, tensorboard_dir: str | None = None, experiment: str | None = None,
                 stream=sys.stdout, clearml: Any = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._stream = stream
        self._tb = None
        self.monitor = CollapseMonitor()
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # optional (tensorboard), only with --use-tensorboard

            self._tb = SummaryWriter(log_dir=os.path.join(tensorboard_dir, experiment or "relax"))
        self.clearml = clearml  # a relax.observability.clearml_sink.ClearMLSink, or None
        self.last_record: dict[str, Any] | None = None
        self.clearml_session: Path | None = None  # the offline session ClearML wrote (offline mode), once closed

    @classmethod
    def from_config(cls, config: Any) -> "MetricsWriter":
        tb_dir = None
        if config.use_tensorboard:
            tb_dir = config.tb_project_name or os.environ.get("TENSORBOARD_DIR") or os.path.join(
                config.output_dir, "tensorboard")
        clearml = None
        if config.use_clearml:
            # Imported only with --use-clearml: importing clearml costs ~1 s of CPU at every start otherwise.
            from relax.observability.clearml_sink import ClearMLSink

            clearml = ClearMLSink.from_config(config)
        return cls(config.output_dir, tensorboard_dir=tb_dir, experiment=config.tb_experiment_name, clearml=clearml)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        self.monitor.check(step, record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.last_record = record
        if self._tb is not None or self.clearml is not None:
            values = scalars(record)
            if self._tb is not None:
                for key, value in values.items():
                    self._tb.add_scalar(key, value, step)
                self._tb.flush()
            if self.clearml is not None:
                self.clearml.log(step, values)
        shown = " ".join(f"{k.split('/')[-1]}={record[k]:.4g}" for k in _STDOUT_KEYS if isinstance(record.get(k), float))
        clear_progress()  # a rollout bar drawn in place on the terminal would run into the step line
        print(f"[relax] step {step}: {shown}", file=self._stream, flush=True)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self.clearml is not None:
            sink, self.clearml = self.clearml, None
            try:
                self.clearml_session = sink.close(resolved_config=self.path.parent / "resolved_config.yaml",
                                                  final_metrics=self.last_record)
            except Exception as exc:  # the run's own outputs are written; a dashboard failure must not hide them
                logging.getLogger("relax.clearml").warning("closing the ClearML task failed: %s", exc)


class CollapseMonitor:
    """Warns about steps without a learning signal (see the module docstring); `check` returns the messages."""

    def __init__(self, entropy_floor: float = ENTROPY_FLOOR, repeat_every: int = 10, log=collapse_log):
        self.entropy_floor = entropy_floor
        self.repeat_every = repeat_every
        self.log = log
        self._streaks: dict[str, int] = {}  # condition -> first step of the running streak

    @staticmethod
    def all_groups_zero_variance(metrics: Mapping[str, Any]) -> bool:
        frac = metrics.get("rollout/zero_std_group_fraction")
        if isinstance(frac, (int, float)):
            return frac >= 1.0
        std, n, groups = (metrics.get(k) for k in ("rollout/reward_std", "rollout/num_samples",
                                                   "rollout/num_groups"))
        if not isinstance(std, (int, float)):
            return False
        if isinstance(n, (int, float)) and isinstance(groups, (int, float)) and n <= groups:
            return False  # one sample per prompt: every group trivially has zero variance
        return std == 0.0

    def check(self, step: int, metrics: Mapping[str, Any]) -> list[str]:
        reward = metrics.get("rollout/reward_mean")
        reward_txt = f"{reward:.3f}" if isinstance(reward, (int, float)) else "n/a"
        entropy = metrics.get("train/entropy")
        found: dict[str, str] = {}
        if self.all_groups_zero_variance(metrics):
            found["zero_variance"] = (
                f"every group has zero reward variance (reward mean {reward_txt}): all advantages are 0, so no "
                "policy gradient this step" + ("; the policy may have collapsed" if reward != 1.0 else
                                                 " (every answer is rewarded: the task is solved)"))
        solved = isinstance(reward, (int, float)) and reward >= SOLVED_REWARD
        if isinstance(entropy, (int, float)) and math.isfinite(entropy) and entropy < self.entropy_floor \
                and not solved:
            found["low_entropy"] = (
                f"train/entropy {entropy:.4f} is below the floor {self.entropy_floor} at reward mean {reward_txt}: "
                "the policy answers almost deterministically without solving the task (collapsed)")
        messages = []
        for cond in list(self._streaks):
            if cond not in found:
                start = self._streaks.pop(cond)
                self.log.info("step %d: %s streak that began at step %d ended", step, cond.replace("_", " "), start)
        for cond, text in found.items():
            start = self._streaks.setdefault(cond, step)
            if (step - start) % self.repeat_every == 0:
                lasting = f" (since step {start})" if step != start else ""
                msg = f"step {step}: {text}{lasting}"
                self.log.warning(msg)
                messages.append(msg)
        return messages


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a record for scalar-only backends (TensorBoard, ClearML): a list of numbers `key`
    becomes `key/mean`, `key/p50`, `key/p90`, `key/max`; strings, empty lists and non-finite values are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            if math.isfinite(value):
                out[key] = float(value)
        elif isinstance(value, (list, tuple)):
            out.update(summarise(key, value))
    return out


def summarise(key: str, values: list | tuple) -> dict[str, float]:
    """`key/mean`, `key/p50`, `key/p90`, `key/max` of the finite numbers in `values` ({} when there are none)."""
    nums = np.array([float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)
                     and math.isfinite(v)], dtype=np.float64)
    if nums.size == 0:
        return {}
    return {f"{key}/mean": float(nums.mean()), f"{key}/p50": float(np.percentile(nums, 50)),
            f"{key}/p90": float(np.percentile(nums, 90)), f"{key}/max": float(nums.max())}


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) > 0:  # tensors and arrays stay lists
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value
    return str(value)
