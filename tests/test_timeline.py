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


def test_reward_calls_are_spans_on_lanes_that_never_overlap(tmp_path, monkeypatch):
    """The reward runner records one span per call (a prompt group in a rollout); calls that overlap on the
    event loop go on separate lanes of the rollout manager's track, and a lane's spans never overlap."""
    import asyncio

    from relax.data.sample import Sample
    from relax.rollout.rewards import RewardRunner

    async def slow(args, sample):
        await asyncio.sleep(0.02)
        return 1.0

    monkeypatch.setenv(timeline.TIMELINE_ENV, str(tmp_path))
    timeline.set_role("rollout manager")
    groups = [[Sample(index=4 * g + i, group_index=g, rollout_step=3, response_text="1") for i in range(2)]
              for g in range(3)]

    async def score_all(runner):
        await asyncio.gather(*(runner.ascore(g, group_size=2, assign=True) for g in groups))
        await runner.ascore(groups[0], group_size=2)  # after the others: lane 0 again

    with RewardRunner(custom_fn=slow) as runner:
        asyncio.run(score_all(runner))
    doc = json.loads(timeline.merge(tmp_path).read_text())
    spans = [s for s in check_chrome_trace(doc) if s["name"] == "reward"]
    assert len(spans) == 4 and all(s["cat"] == "reward" for s in spans)
    assert all(s["args"]["step"] == 3 and s["args"]["samples"] == 2 and s["args"]["errors"] == 0 for s in spans)
    lanes = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(lanes[s["tid"]] for s in spans) == ["reward 0", "reward 0", "reward 1", "reward 2"]
    assert_lanes_do_not_overlap(spans)


def assert_lanes_do_not_overlap(spans: list[dict]) -> None:
    """Spans of one track (process and thread or lane) follow each other or nest, as Perfetto draws them."""
    by_track: dict[tuple, list[dict]] = {}
    for s in spans:
        by_track.setdefault((s["pid"], s["tid"]), []).append(s)
    for track in by_track.values():
        track.sort(key=lambda s: s["ts"])
        for a, b in zip(track, track[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1, (a, b)
