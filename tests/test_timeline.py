"""--timeline-dump-dir: spans written by several processes merge into a valid Chrome trace whose spans nest."""

import json
import multiprocessing
import time

import pytest

from relax.observability import timeline


def _child(directory):
    import os

    os.environ[timeline.TIMELINE_ENV] = directory
    timeline.set_role("engine 0")
    with timeline.span("generate", step=0, cat="rollout"):
        time.sleep(0.01)


def check_chrome_trace(doc: dict) -> list[dict]:
    """The complete events of a Chrome trace-event document, after checking its format."""
    assert set(doc) >= {"traceEvents"}
    spans = []
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["name"], str) and e["ts"] > 0 and e["dur"] >= 0
            spans.append(e)
        else:
            assert e["name"] in ("process_name", "thread_name") and e["args"]["name"]
    named = {e["pid"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert {s["pid"] for s in spans} <= named  # every track has a name
    return spans


def test_spans_of_processes_merge_into_a_chrome_trace(tmp_path, monkeypatch):
    monkeypatch.setenv(timeline.TIMELINE_ENV, str(tmp_path))
    timeline.set_role("controller")
    with timeline.span("step", step=0):
        with timeline.span("train", step=0, cat="train"):
            time.sleep(0.01)
        proc = multiprocessing.get_context("spawn").Process(target=_child, args=(str(tmp_path),))
        proc.start()
        proc.join(60)
    with pytest.raises(ValueError):
        with timeline.span("save", step=0):
            raise ValueError("disk full")
    (tmp_path / "spans" / "torn.jsonl").write_text('{"name": "cut sho')  # a process killed mid-line
    doc = json.loads(timeline.merge(tmp_path).read_text())
    spans = {s["name"]: s for s in check_chrome_trace(doc)}
    assert set(spans) == {"step", "train", "generate", "save"}
    step, train, gen = spans["step"], spans["train"], spans["generate"]
    assert step["ts"] <= train["ts"] and train["ts"] + train["dur"] <= step["ts"] + step["dur"]
    assert step["ts"] <= gen["ts"] and gen["ts"] + gen["dur"] <= step["ts"] + step["dur"]
    assert gen["pid"] != step["pid"] and gen["args"] == {"step": 0}
    assert spans["save"]["args"] == {"step": 0, "error": "ValueError"}
    names = {e["args"]["name"].split(" (")[0] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {"controller", "engine 0"}


def test_nothing_is_written_without_the_flag(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline.TIMELINE_ENV, raising=False)
    with timeline.span("step", step=0):
        pass
    assert not timeline.enabled() and not list(tmp_path.iterdir())
