"""The autoscaler's status: OUTPUT_DIR/autoscaler_status.json written (atomically) with the engines, their last
scraped metrics and the newest decisions after each observation and decision; `relax-status RUN_DIR` showing it (text,
--json, --watch, the one-line error of a run without it); the metrics service's /autoscaler. No Ray: a fake pool
and a fake /metrics, as in tests/test_autoscaler.py's unit tests."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

import relax.rollout.autoscaler as autoscaler
from relax.config.autoscaler import AutoscalerConfig, ScaleOutPolicy
from relax.entrypoints import status as cli
from relax.observability.autoscaler_status import STATUS_FILE, format_status
from relax.observability.metrics_service import MetricsStore, serve
from relax.rollout.autoscaler import Autoscaler, LoadSample, histogram_quantile

ROOT = Path(__file__).resolve().parents[1]


class Pool:
    """The engine pool's interface: engine 0 active at weight version 3, an engine starting, `add` immediate."""

    def __init__(self, status_file=None):
        self.active = ["http://e0"]
        self.status_file = status_file
        self.seen_during_add = None
        self.lock = threading.Lock()

    def urls(self):
        with self.lock:
            return list(self.active)

    def list(self):
        engines = [{"id": int(u[len("http://e"):]), "url": u, "state": "active", "weight_version": "3"}
                   for u in self.urls()]
        return engines + [{"id": 9, "url": None, "state": "starting", "weight_version": None}]

    def add(self, count=1, cancel=None):
        if self.status_file is not None:  # what relax-status shows while the scale-out is under way
            self.seen_during_add = json.loads(self.status_file.read_text())["scaling"]
        with self.lock:
            url = f"http://e{len(self.active)}"
            self.active.append(url)
        return [url]


def _metrics(generated, queue_buckets):
    les = ("0.1", "1.0", "+Inf")
    return {'sglang:token_usage{model_name="m"}': 0.9, 'sglang:num_queue_reqs{model_name="m"}': 25.0,
            'sglang:num_running_reqs{model_name="m"}': 8.0,
            'sglang:generation_tokens_total{model_name="m"}': generated,
            **{f'sglang:queue_time_seconds_bucket{{le="{le}",model_name="m"}}': n for le, n in zip(les, queue_buckets)}}


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A run folder after two observations of a busy engine, a hold and a scale-out."""
    scrapes = iter([_metrics(1000.0, (0, 0, 0)), _metrics(1100.0, (10, 20, 20))])
    monkeypatch.setattr(autoscaler, "scrape_engine_metrics", lambda url, api_key=None, timeout_s=5.0: next(scrapes))
    cfg = AutoscalerConfig(min_engines=1, max_engines=3, scale_out_cooldown_secs=0,
                           scale_out_policy=ScaleOutPolicy(condition_duration_secs=1, queue_depth_per_engine=10,
                                                           max_delta=1))
    pool = Pool(tmp_path / STATUS_FILE)
    published = []
    scaler = Autoscaler(cfg, pool, scale_out_timeout_s=5, partial_policy="rollback_all", drain_timeout_s=1,
                        log_path=str(tmp_path / "autoscaler.jsonl"), publish=published.append)
    assert scaler.step().action == "hold"  # no metrics yet
    scaler.observe()
    time.sleep(0.05)
    scaler.observe()
    now = time.monotonic()  # the window the decision reads: a queue of 25 per engine for 2 s
    scaler.samples = [LoadSample(time=now - 2 + 0.5 * i, engines=1, token_usage=0.9, queue_per_engine=25.0,
                                 throughput=100.0) for i in range(5)]
    assert scaler.step().action == "scale_out"
    return tmp_path, scaler, pool, published


def test_the_status_file_has_the_engines_their_metrics_and_every_decision(run_dir):
    tmp_path, scaler, pool, published = run_dir
    status = json.loads((tmp_path / STATUS_FILE).read_text())
    assert status["state"] == "running" and time.time() - status["time"] < 10
    assert (status["config"]["min_engines"], status["config"]["max_engines"]) == (1, 3)
    assert status["config"]["scale_in_cooldown_secs"] == 300 and status["active_engines"] == 2
    by_id = {e["id"]: e for e in status["engines"]}
    e0 = by_id[0]
    assert (e0["url"], e0["state"], e0["weight_version"]) == ("http://e0", "active", "3")
    m = e0["metrics"]
    assert (m["sglang:token_usage"], m["sglang:num_queue_reqs"], m["sglang:num_running_reqs"]) == (0.9, 25.0, 8.0)
    assert m["sglang:gen_throughput"] > 0  # 100 tokens between the two scrapes
    # 20 requests since the last scrape, 10 under 0.1 s, all under 1 s: p95 at 0.1 + 0.9 * 9/10
    assert m["sglang:queue_time_seconds:p95"] == pytest.approx(0.91)
    assert e0["scrape_error"] is None and time.time() - e0["scraped_at"] < 10
    assert by_id[1]["metrics"] is None and by_id[9]["state"] == "starting"  # added since the last observation
    hold, out = status["decisions"]
    assert (hold["action"], hold["reason"]) == ("hold", "no metrics yet")
    assert (out["action"], out["delta"], out["engines"], out["urls"]) == ("scale_out", 1, 2, ["http://e1"])
    assert "queue per engine above 10" in out["reason"] and out["done_time"] >= out["time"]
    assert status["scaling"] is None and status["last_sample"] is None  # a scale-out starts a new window
    assert time.time() - published[-3]["last_sample"]["time"] < 10  # as of the last observation (Unix time)
    # while the scale-out was under way the file said so
    assert pool.seen_during_add["action"] == "scale_out" and pool.seen_during_add["delta"] == 1
    # one source: status() builds what the file holds, and the published status is the file
    assert published[-1] == status
    assert set(scaler.status()) == set(status)
    rows = [json.loads(line) for line in (tmp_path / "autoscaler.jsonl").read_text().splitlines()]
    assert rows == status["decisions"]
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed over the status
    scaler.stop()
    assert json.loads((tmp_path / STATUS_FILE).read_text())["state"] == "stopped"


def test_relax_status_prints_the_engines_and_the_decisions_newest_first(run_dir, capsys):
    tmp_path = run_dir[0]
    assert cli.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"autoscaler of {tmp_path}: running, updated ") and " s ago" in lines[0]
    assert "engines: 2 active within [1, 3]; scaling now: no" in lines[1]
    assert "scale-out 0 s, scale-in 300 s" in lines[2]
    e0 = next(line for line in lines if "http://e0" in line)
    for part in ("#0", "active", "v3", "usage 0.900", "running 8", "queued 25", "tok/s", "queue p95 0.91 s"):
        assert part in e0, (part, e0)
    assert any("#9" in line and "starting" in line and "(no url yet)" in line for line in lines)
    first = lines.index("decisions, newest first (2 of 2):")
    out_line, hold_line = lines[first + 1], lines[first + 2]
    assert "scale_out" in out_line and "1->2" in out_line and "queue per engine above 10" in out_line
    assert "[added 1 of 1, in " in out_line
    assert "hold" in hold_line and "no metrics yet" in hold_line and "[-]" in hold_line
    assert cli.main([str(tmp_path), "--last", "1"]) == 0
    out = capsys.readouterr().out
    assert "decisions, newest first (1 of 2; --last 0 for all):" in out
    assert "  hold " not in out


def test_the_status_keeps_the_newest_decisions_and_the_log_every_one(run_dir, capsys):
    """A "hold" row every evaluation: a long run's status keeps the newest KEPT_DECISIONS, autoscaler.jsonl all."""
    tmp_path, scaler, _, _ = run_dir
    kept = autoscaler.KEPT_DECISIONS
    for i in range(kept + 5):
        scaler._record("hold", 0, f"evaluation {i}")
    status = json.loads((tmp_path / STATUS_FILE).read_text())
    assert len(status["decisions"]) == kept and status["decisions_total"] == kept + 7  # 2 made by the fixture
    assert status["decisions"][-1]["reason"] == f"evaluation {kept + 4}"
    assert status["decisions"][0]["reason"] == "evaluation 5"  # the 7 oldest left out
    assert len((tmp_path / "autoscaler.jsonl").read_text().splitlines()) == kept + 7
    assert cli.main([str(tmp_path), "--last", "2"]) == 0
    assert (f"decisions, newest first (2 of {kept + 7}; --last 0 for the kept ones; every one in autoscaler.jsonl):"
            in capsys.readouterr().out)


def test_relax_status_json_prints_the_file_and_watch_refreshes(run_dir, capsys, monkeypatch):
    tmp_path = run_dir[0]
    assert cli.main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads((tmp_path / STATUS_FILE).read_text())
    sleeps = []

    def sleep(seconds):  # the second wait is the user's Ctrl-C
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli.time, "sleep", sleep)
    assert cli.main([str(tmp_path / STATUS_FILE), "--watch", "2"]) == 0
    assert sleeps == [2.0, 2.0] and capsys.readouterr().out.count("decisions, newest first") == 2


def test_a_run_without_autoscaler_status_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli.main([str(tmp_path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and "\n" not in err and "Traceback" not in err
    assert err.startswith("relax-status: error: ") and str(tmp_path / STATUS_FILE) in err
    assert "--autoscaler-config" in err
    assert cli.main([str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / STATUS_FILE).write_text("{")
    assert cli.main([str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    # the installed console script (setup.py), as a user runs it
    script = Path(sys.executable).parent / "relax-status"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "relax.entrypoints.status"]
    result = subprocess.run([*cmd, str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                            cwd=str(ROOT))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("relax-status: error: ")


def test_histogram_quantile_and_a_scaling_shown_under_way():
    assert histogram_quantile(0.95, {}) is None and histogram_quantile(0.95, {1.0: 0, float("inf"): 0}) is None
    assert histogram_quantile(0.5, {1.0: 10, 2.0: 20, float("inf"): 20}) == pytest.approx(1.0)
    assert histogram_quantile(0.95, {1.0: 10, 2.0: 20, float("inf"): 20}) == pytest.approx(1.9)
    assert histogram_quantile(0.95, {1.0: 0, float("inf"): 4}) == 1.0  # in +Inf: the highest finite bound
    now = 1_000_000.0
    text = format_status({"time": now - 5, "config": {"min_engines": 1, "max_engines": 4}, "engines": [],
                          "scaling": {"action": "scale_in", "delta": -1, "time": now - 3, "reason": "idle"},
                          "last_sample": {"time": now - 6, "token_usage": 0.1, "queue_per_engine": 0.0,
                                          "throughput": 55.0}, "decisions": []}, now=now)
    assert "updated 5 s ago" in text and "scaling now: scale_in -1, decided 3 s ago (idle)" in text
    assert "load (means over the active engines, 6 s ago): usage 0.100, queue/engine 0.0, 55.0 tok/s in all" in text
    assert "(none yet)" in text and "(no engines)" in text


def test_the_metrics_service_serves_the_published_status_at_autoscaler():
    store = MetricsStore()
    server = serve(store, "127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/autoscaler"
        missing = requests.get(url, timeout=10)
        assert missing.status_code == 404 and "--autoscaler-config" in missing.text
        status = {"time": 1.0, "engines": [{"url": "http://e0", "metrics": {"sglang:token_usage": float("nan")}}],
                  "decisions": [{"action": "hold", "reason": "load within bounds"}]}
        store.set_document("autoscaler", status)
        got = requests.get(url, timeout=10).json()
        assert got["decisions"] == status["decisions"] and got["engines"][0]["metrics"]["sglang:token_usage"] is None
    finally:
        server.shutdown()
        server.server_close()
