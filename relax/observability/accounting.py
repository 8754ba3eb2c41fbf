"""Sample accounting: where every sample of a step went, so that nothing disappears unaccounted.

Per step (metrics, in samples; `samples/filtered/<reason>` and `samples/dropped/<reason>` by reason):

    samples/generated          completed generations (a prompt group counts once it is scored)
    samples/filtered           generated, then dropped by --dynamic-sampling-filter-path
    samples/returned_surplus   generated beyond --rollout-batch-size: back to the data source, served next step
    samples/returned_in_flight  still in flight when the target was reached: back to the data source (resumed
                               with --partial-rollout, else generated again)
    samples/kept               what the rollout function returned (--rollout-batch-size groups)
    samples/dropped            removed by --rollout-data-postprocess-path
    samples/added              added by --rollout-data-postprocess-path
    samples/to_train           written to the step's data-plane partition
    samples/trained            read by the trainer and used by its updates (0 while only the critic trains)
    samples/reward_failed      generated samples whose reward failed (--reward-error-policy), still in the counts

Identities (checked every step by `step_problems`):

    generated = kept + filtered + returned_surplus        (the default rollout function; a custom one reports
                                                           only kept)
    to_train  = kept - dropped + added
    trained   = to_train                                  (when the step trains)

`RunAccounting` adds the steps up for the end-of-run summary (logged, and `<output-dir>/sample_accounting.json`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Mapping

PREFIX = "samples/"


def rollout_accounting(*, generated: int, kept: int, filtered: Mapping[str, int], returned_surplus: int,
                       returned_in_flight: int) -> dict[str, float]:
    """The rollout function's part of a step's accounting (all counts in samples)."""
    out = {
        "samples/generated": float(generated),
        "samples/kept": float(kept),
        "samples/filtered": float(sum(filtered.values())),
        "samples/returned_surplus": float(returned_surplus),
        "samples/returned_in_flight": float(returned_in_flight),
    }
    for reason, n in filtered.items():
        out[f"samples/filtered/{reason}"] = float(n)
    return out


def delivery_accounting(*, kept: int, to_train: int) -> dict[str, float]:
    """What happened between the rollout function and the data plane (the postprocess hook)."""
    return {"samples/kept": float(kept), "samples/to_train": float(to_train),
            "samples/dropped": float(max(0, kept - to_train)),
            **({"samples/dropped/postprocess": float(kept - to_train)} if kept > to_train else {}),
            "samples/added": float(max(0, to_train - kept))}


def step_problems(metrics: Mapping[str, float], *, trained_expected: bool) -> list[str]:
    """The identities above that do not hold for one step's metrics (empty: every sample is accounted for)."""
    get = lambda key: metrics.get(PREFIX + key)  # noqa: E731
    problems = []
    if get("generated") is not None and get("kept") is not None:
        accounted = get("kept") + (get("filtered") or 0) + (get("returned_surplus") or 0)
        if accounted != get("generated"):
            problems.append(f"generated {get('generated'):.0f} != kept {get('kept'):.0f} + filtered "
                            f"{get('filtered') or 0:.0f} + returned {get('returned_surplus') or 0:.0f}")
    if get("to_train") is not None and get("kept") is not None:
        if get("kept") - (get("dropped") or 0) + (get("added") or 0) != get("to_train"):
            problems.append(f"to_train {get('to_train'):.0f} != kept {get('kept'):.0f} - dropped "
                            f"{get('dropped') or 0:.0f} + added {get('added') or 0:.0f}")
    if trained_expected and get("to_train") is not None and get("trained") is not None:
        if get("trained") != get("to_train"):
            problems.append(f"trained {get('trained'):.0f} != to_train {get('to_train'):.0f}")
    return problems


class RunAccounting:
    """Adds up the `samples/*` metrics of every step."""

    def __init__(self) -> None:
        self.totals: Counter = Counter()
        self.steps = 0

    def add(self, metrics: Mapping[str, float]) -> None:
        self.steps += 1
        for key, value in metrics.items():
            if key.startswith(PREFIX):
                self.totals[key[len(PREFIX):]] += int(value)

    def summary_line(self) -> str:
        t = self.totals
        parts = [f"{t['generated']} generated", f"{t['reward_failed']} with a failed reward",
                 f"{t['filtered']} filtered", f"{t['returned_surplus'] + t['returned_in_flight']} returned to the "
                 f"data source", f"{t['to_train']} sent to training", f"{t['trained']} trained",
                 f"{t['dropped']} dropped"]
        reasons = [f"{k.split('/', 1)[1]} {v}" for k, v in sorted(t.items()) if "/" in k and v]
        return (f"samples over {self.steps} step(s): " + ", ".join(parts)
                + (f" (by reason: {', '.join(reasons)})" if reasons else ""))

    def write(self, output_dir: str | Path) -> Path:
        path = Path(output_dir) / "sample_accounting.json"
        path.write_text(json.dumps({"steps": self.steps, "totals": dict(sorted(self.totals.items()))}, indent=1))
        return path
