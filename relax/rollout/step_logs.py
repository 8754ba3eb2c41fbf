"""Optional per-step rollout statistics: `--log-multi-turn`, `--log-correct-samples`, `--log-reward-category`.

All functions are pure (samples in, metrics out) except `write_correct_samples`, which writes a file.

* `multi_turn_metrics` (`multi_turn/...`): model turns per sample (runs of loss-mask-1 tokens, or the
  sample's `metadata["turns"]` when the generate function records it), tool calls per sample
  (`metadata["tool_calls"]`, else the environment runs that follow a model turn), model tokens (mask 1)
  and environment tokens (mask 0) per sample, the environment-token fraction, and the fraction of
  samples with more than one turn.
* `correct_metrics` (`rollout/correct_...`): a sample is correct when its reward is > 0 (the pass@k
  rule). `write_correct_samples` writes up to `CORRECT_SAMPLES_PER_STEP` of them per step to
  `<--output-dir>/correct_samples/step_<N>.jsonl` (prompt, response text, label, reward).
* `reward_category_metrics` (`reward_category/<cat>/...`): the category of a sample is
  `raw_reward[KEY]` of its dict-valued reward (`Sample.raw_reward`); per category the count, the
  fraction of samples and the mean reward. Samples whose reward is not a dict with KEY count under
  `reward_category/_missing/count`.
* `group_variance_metrics` (`rollout/zero_std_...`): the number and fraction of prompt groups whose rewards
  are all equal (they get GRPO advantage 0); `relax.observability.metrics.CollapseMonitor` warns when the
  fraction is 1. Always part of `step_log_metrics`.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from typing import Any, Sequence

CORRECT_SAMPLES_PER_STEP = 8


def mask_runs(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of equal mask values as (value, length), in order."""
    runs: list[tuple[int, int]] = []
    for m in loss_mask:
        m = 1 if m else 0
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1] + 1)
        else:
            runs.append((m, 1))
    return runs


def sample_turns(sample: Any) -> tuple[int, int, int, int]:
    """(model turns, tool calls, model tokens, environment tokens) of one sample."""
    mask = list(sample.loss_mask) if sample.loss_mask else [1] * len(sample.response_tokens)
    runs = mask_runs(mask)
    model_tokens = sum(n for m, n in runs if m == 1)
    env_tokens = sum(n for m, n in runs if m == 0)
    md = sample.metadata or {}
    turns = int(md["turns"]) if "turns" in md else sum(1 for m, _ in runs if m == 1)
    if "tool_calls" in md:
        calls = int(md["tool_calls"])
    else:  # an environment run after a model run answers that turn
        calls = sum(1 for i, (m, _) in enumerate(runs) if m == 0 and i > 0 and runs[i - 1][0] == 1)
    return turns, calls, model_tokens, env_tokens


def multi_turn_metrics(samples: Sequence[Any], prefix: str = "multi_turn/") -> dict[str, float]:
    if not samples:
        return {}
    per = [sample_turns(s) for s in samples]
    turns = [p[0] for p in per]
    calls = [p[1] for p in per]
    model = sum(p[2] for p in per)
    env = sum(p[3] for p in per)
    return {
        f"{prefix}turns_mean": statistics.fmean(turns),
        f"{prefix}turns_max": float(max(turns)),
        f"{prefix}tool_calls_mean": statistics.fmean(calls),
        f"{prefix}tool_calls_total": float(sum(calls)),
        f"{prefix}model_tokens_mean": model / len(samples),
        f"{prefix}env_tokens_mean": env / len(samples),
        f"{prefix}env_token_fraction": env / (model + env) if model + env else 0.0,
        f"{prefix}multi_turn_fraction": sum(t > 1 for t in turns) / len(samples),
    }


def is_correct(sample: Any) -> bool:
    return float(sample.reward) > 0


def correct_metrics(samples: Sequence[Any], prefix: str = "rollout/") -> dict[str, float]:
    if not samples:
        return {}
    correct = [s for s in samples if is_correct(s)]
    lengths = [len(s.response_tokens) for s in correct]
    return {
        f"{prefix}correct_samples": float(len(correct)),
        f"{prefix}correct_fraction": len(correct) / len(samples),
        f"{prefix}correct_response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
    }


def write_correct_samples(output_dir: str, step: int, samples: Sequence[Any],
                          limit: int = CORRECT_SAMPLES_PER_STEP) -> str:
    """Write up to `limit` correct samples of a step (highest reward first); returns the file path."""
    chosen = sorted((s for s in samples if is_correct(s)), key=lambda s: (-float(s.reward), s.index))[:limit]
    folder = os.path.join(output_dir, "correct_samples")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{step}.jsonl")
    with open(path, "w") as f:
        for s in chosen:
            f.write(json.dumps({"step": step, "index": s.index, "group_index": s.group_index, "prompt": s.prompt,
                                "response": s.response_text, "label": s.label, "reward": float(s.reward)},
                               default=str) + "\n")
    return path


_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]+")


def category_name(value: Any) -> str:
    """A metric-safe category name (slashes and spaces become '_')."""
    name = _UNSAFE.sub("_", str(value)).strip("_")
    return name or "_empty"


def reward_category_metrics(samples: Sequence[Any], key: str, prefix: str = "reward_category/") -> dict[str, float]:
    if not samples:
        return {}
    by_cat: dict[str, list[float]] = {}
    for s in samples:
        raw = s.raw_reward
        cat = category_name(raw[key]) if isinstance(raw, dict) and key in raw else "_missing"
        by_cat.setdefault(cat, []).append(float(s.reward))
    out: dict[str, float] = {}
    for cat, rewards in sorted(by_cat.items()):
        out[f"{prefix}{cat}/count"] = float(len(rewards))
        out[f"{prefix}{cat}/fraction"] = len(rewards) / len(samples)
        out[f"{prefix}{cat}/reward_mean"] = statistics.fmean(rewards)
    return out


def group_variance_metrics(samples: Sequence[Any], prefix: str = "rollout/") -> dict[str, float]:
    """Groups (by `group_index`) of more than one sample whose rewards are all equal: count and fraction."""
    groups: dict[Any, list[float]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(float(s.reward))
    multi = [g for g in groups.values() if len(g) > 1]
    if not multi:
        return {}
    zero = sum(1 for g in multi if max(g) == min(g))
    return {f"{prefix}zero_std_groups": float(zero), f"{prefix}zero_std_group_fraction": zero / len(multi)}


def step_log_metrics(config: Any, step: int, samples: Sequence[Any]) -> dict[str, float]:
    """The metrics of the enabled --log-* flags for one rollout step (writes correct samples when asked)."""
    out: dict[str, float] = group_variance_metrics(samples)
    if config.log_multi_turn:
        out.update(multi_turn_metrics(samples))
    if config.log_correct_samples:
        out.update(correct_metrics(samples))
        write_correct_samples(config.output_dir, step, samples)
    if config.log_reward_category:
        out.update(reward_category_metrics(samples, config.log_reward_category))
    return out
