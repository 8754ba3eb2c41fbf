"""Learning metrics of whole runs recorded in tests/data/stages_exact_reference.json, compared with == .

A run's float results depend on the machine's CPU kernels (SIMD width, oneDNN's choice of kernel round
differently), so each name keeps one recording per kernel family it was recorded on ("variants"); a run must
equal one of them exactly. A numerics regression moves a run away from every variant. Record with
RELAX_RECORD_STAGES=1: a run that equals no variant is added as a new one, recorded from the code whose results
the tests then hold (the note of the change says which commit and machine)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

FIXTURE = Path(__file__).parent / "data" / "stages_exact_reference.json"
RECORD = os.environ.get("RELAX_RECORD_STAGES") == "1"


def _differ(want: list[dict], have: list[dict]) -> str | None:
    """None when `have` holds every metric of `want` with an equal value at every step; else the first step's
    differences."""
    if len(want) != len(have):
        return f"{len(have)} steps, recorded {len(want)}"
    for step, (a, b) in enumerate(zip(want, have)):
        missing = sorted(set(a) - set(b))
        if missing:
            return f"step {step}: metrics no longer reported: {missing}"
        diff = {k: (a[k], b[k]) for k in a
                if not (a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])))}
        if diff:
            return f"step {step}: (recorded, now) differ: {diff}"
    return None


def variants(name: str) -> list[list[dict]]:
    return json.loads(FIXTURE.read_text())[name]


def record(name: str, records: list[dict]) -> None:
    """Add `records` as a variant of `name` unless one equals it."""
    data = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    known = data.setdefault(name, [])
    if all(_differ(v, records) is not None for v in known):
        known.append(records)
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def check(name: str, records: list[dict]) -> None:
    """Assert that `records` equal one recorded variant of `name` (metrics added since are not compared)."""
    found = variants(name)
    assert found, f"{name}: nothing recorded"
    reasons = [_differ(v, records) for v in found]
    assert any(r is None for r in reasons), f"{name} equals none of its {len(found)} recorded variant(s): " + \
        "; ".join(f"variant {i}: {r}" for i, r in enumerate(reasons))
