"""--use-clearml, checked for real with ClearML's offline mode (CLEARML_OFFLINE_MODE=1): the session zip ClearML
writes is read back for the scalars of every metrics.jsonl record, the resolved config as hyperparameters and
the artifacts; list-valued metrics are summarised; without a server or offline mode the run stops before Ray."""

import json
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest

from conftest import relax_cli
from relax.config import ConfigError, parse_config
from relax.config.explain import write_resolved_config
from relax.entrypoints.train import main
from relax.observability import clearml_sink
from relax.observability.metrics import MetricsWriter, scalars, summarise
from test_notify import LocalHook

SECRET = "Cl34rMLs3cr3t"
FIXTURE = Path(__file__).parent / "data" / "run_metrics.jsonl"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    monkeypatch.setenv("TRAINS_OFFLINE_MODE", "1")  # Task.set_offline sets both names; both are undone after
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path / "clearml-cache"))
    return tmp_path / "clearml-cache"


def read_session(path: Path) -> dict:
    """task.json, the scalar events {(title, series, iteration): value}, artifact files and all bytes of a
    ClearML offline session zip."""
    with zipfile.ZipFile(path) as z:
        task = json.loads(z.read("task.json"))
        events = [event for line in z.read("metrics.jsonl").decode().splitlines() if line.strip()
                  for event in json.loads(line)]
        files = {name: z.read(name) for name in z.namelist()}
    scalar_events = {(e["metric"], e["variant"], e["iter"]): e["value"] for e in events
                     if e.get("type") == "training_stats_scalar"}
    return {"task": task, "scalars": scalar_events, "files": files, "blob": b"".join(files.values())}


def assert_scalars_reported(session: dict, records: list[dict]) -> int:
    """Every scalar of every metrics.jsonl record is in the session at its step; returns how many."""
    count = 0
    for record in records:
        for key, value in scalars(record).items():
            title, _, series = key.partition("/")
            got = session["scalars"].get((title, series or title, record["step"]))
            assert got == pytest.approx(value, rel=1e-6, abs=1e-9), (key, record["step"], got, value)
            count += 1
    return count


def test_list_metrics_are_summarised_for_scalar_backends():
    assert summarise("rollout/lens", [1, 2, 3, 4, 10]) == {
        "rollout/lens/mean": 4.0, "rollout/lens/p50": 3.0, "rollout/lens/p90": pytest.approx(7.6),
        "rollout/lens/max": 10.0}
    assert summarise("x", []) == {} and summarise("x", ["a", float("nan")]) == {}
    record = {"step": 3, "a": 1, "b": 2.5, "c": float("inf"), "d": "text", "e": True, "f": [2, 4]}
    assert scalars(record) == {"a": 1.0, "b": 2.5, "f/mean": 3.0, "f/p50": 3.0, "f/p90": pytest.approx(3.8),
                               "f/max": 4.0}


def test_metrics_writer_reports_to_an_offline_task(tmp_path, offline):
    out = tmp_path / "run"
    config = parse_config(["--output-dir", str(out), "--use-clearml", "--tb-project-name", "relax-tests",
                           "--tb-experiment-name", "offline-unit", "--lr", "3e-4",
                           "--notify-urls", f"json://u:{SECRET}@127.0.0.1:9/hook/{SECRET}"])
    write_resolved_config(config)
    writer = MetricsWriter.from_config(config)
    real = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    for record in real:
        metrics = {k: v for k, v in record.items() if k != "step"}
        writer.log(record["step"], {**metrics, "rollout/response_lengths": [1, 2, 3, 10 + record["step"]],
                                    "rollout/note": "not a number"})
    writer.close()
    written = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert written[0]["rollout/response_lengths"] == [1, 2, 3, 10]  # metrics.jsonl keeps the list

    zipped = writer.clearml_session
    assert zipped is not None and zipped.suffix == ".zip" and zipped.is_relative_to(offline)
    session = read_session(zipped)
    task = session["task"]
    assert task["name"] == "offline-unit" and task["project_name"] == "relax-tests"
    assert assert_scalars_reported(session, written) >= 3 * 60
    assert session["scalars"][("rollout", "response_lengths/max", 2)] == 12.0
    assert session["scalars"][("rollout", "response_lengths/p50", 0)] == 2.5
    assert not any(series == "note" for _, series, _ in session["scalars"])

    params = {name: p["value"] for name, p in task["hyperparams"]["relax"].items()}
    assert params["lr"] == "0.0003" and params["output_dir"] == str(out) and params["use_clearml"] == "True"
    assert params["notify_urls"] == "json://<redacted>"
    assert len(params) > 200  # the whole resolved config, not a few flags

    artifacts = {a["key"]: a for a in task["execution"]["artifacts"]}
    assert set(artifacts) == {"resolved_config", "final_metrics"}
    final = next(v for n, v in session["files"].items() if n.endswith("final_metrics.json"))
    assert json.loads(final) == written[-1]
    resolved = next(v for n, v in session["files"].items() if n.endswith("resolved_config.yaml"))
    assert resolved == (out / "resolved_config.yaml").read_bytes()
    assert SECRET.encode() not in session["blob"]


def _use_controller(monkeypatch, run_controller):
    monkeypatch.setitem(sys.modules, "relax.core.run", types.SimpleNamespace(run_controller=run_controller))


def test_without_server_or_offline_mode_the_run_stops_before_ray(tmp_path, monkeypatch, capsys):
    for name in ("CLEARML_OFFLINE_MODE", "TRAINS_OFFLINE_MODE", "CLEARML_API_HOST", "CLEARML_API_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(clearml_sink, "get_active_config_file", lambda: None)  # no ~/clearml.conf
    _use_controller(monkeypatch, lambda config: pytest.fail("the run must not start"))
    assert main(["--output-dir", str(tmp_path / "out"), "--use-clearml"]) == 2
    err = capsys.readouterr().err
    assert "relax-train: error: --use-clearml: ClearML is not configured" in err
    assert "clearml-init" in err and "CLEARML_OFFLINE_MODE=1" in err
    config = parse_config(["--output-dir", str(tmp_path / "out"), "--use-clearml"])
    with pytest.raises(ConfigError):
        clearml_sink.require_clearml_target(config)
    monkeypatch.setenv("CLEARML_API_HOST", "https://clearml.example:8008")  # a configured server: accepted
    clearml_sink.require_clearml_target(config)
    monkeypatch.delenv("CLEARML_API_HOST")
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    _use_controller(monkeypatch, lambda config: 0)
    assert main(["--output-dir", str(tmp_path / "out"), "--use-clearml"]) == 0


@pytest.mark.e2e
def test_a_short_run_reports_to_clearml_and_notifies(tmp_path, tiny_model, prompt_file, monkeypatch):
    """relax-train with --use-clearml (offline) and --notify-urls on the tiny model, 2 steps: the session holds
    every scalar of metrics.jsonl, the config and the artifacts; the endpoint got started and finished; the
    URL's secret is in nothing the run wrote."""
    hook = LocalHook()
    cache = tmp_path / "clearml-cache"
    out = tmp_path / "run"
    # A ClearML task made earlier in this process (the unit tests above) leaves CLEARML_* variables that make a
    # child's Task.init join that task instead of starting its own: the run must start from a clean environment.
    for name in [n for n in os.environ if n.startswith(("CLEARML_", "TRAINS_"))]:
        monkeypatch.delenv(name)
    try:
        proc = relax_cli(
            "--hf-checkpoint", tiny_model, "--prompt-data", prompt_file, "--input-key", "input",
            "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "2", "--rollout-max-response-len", "3",
            "--micro-batch-size", "2", "--output-dir", str(out), "--use-clearml",
            "--tb-project-name", "relax-e2e", "--tb-experiment-name", "clearml-notify",
            "--notify-urls", hook.url(SECRET),
            env={"CLEARML_OFFLINE_MODE": "1", "CLEARML_CACHE_DIR": str(cache)}, timeout=600)
    finally:
        hook.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]

    zips = list((cache / "offline").glob("*.zip"))
    assert len(zips) == 1, list(cache.rglob("*"))
    session = read_session(zips[0])
    assert session["task"]["name"] == "clearml-notify" and session["task"]["project_name"] == "relax-e2e"
    assert assert_scalars_reported(session, records) >= 2 * 30
    params = {name: p["value"] for name, p in session["task"]["hyperparams"]["relax"].items()}
    assert params["num_rollout"] == "2" and params["notify_urls"] == "json://<redacted>"
    assert {a["key"] for a in session["task"]["execution"]["artifacts"]} == {"resolved_config", "final_metrics"}

    started, finished = hook.messages()
    assert started["type"] == "info" and "relax run clearml-notify started" == started["title"]
    assert finished["type"] == "success" and "last step 1" in finished["message"]
    sources = {"stdout": proc.stdout, "stderr": proc.stderr, **{str(p): p.read_text(errors="replace")
                                                                for p in out.rglob("*") if p.is_file()},
               **{f"session {n}": v.decode(errors="replace") for n, v in session["files"].items()}}
    leaks = {name: _around(text, SECRET) for name, text in sources.items() if SECRET in text}
    assert not leaks, leaks


def _around(text: str, word: str, width: int = 150) -> str:
    i = text.index(word)
    return text[max(0, i - width):i + width]
