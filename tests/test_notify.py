"""--notify-urls through Apprise's JSON target to a local HTTP endpoint: started, finished and failed (with the
first error line) messages; secrets of the URLs never in logs or the resolved config; a failed delivery warns
once and never ends the run."""

import json
import logging
import socket
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import relax_cli
from relax.config import ConfigError, parse_config
from relax.config.explain import resolved_values
from relax.config.redact import redact_command
from relax.entrypoints.train import main
from relax.observability.notify import Notifier, check_urls, split_urls

SECRET = "S3cretT0ken42"
GOOD_PROMPTS = '{"input": "1+1=", "label": "2"}\n{"input": "2+2=", "label": "4"}\n'


class LocalHook:
    """A tiny HTTP server that records every JSON POST (path, body) it receives."""

    def __init__(self):
        self.received: list[tuple[str, dict]] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hook.received.append((self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, secret: str = SECRET) -> str:
        return f"json://relax:{secret}@127.0.0.1:{self.port}/hook/{secret}"

    def messages(self) -> list[dict]:
        return [body for _, body in self.received]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook():
    server = LocalHook()
    yield server
    server.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_started_finished_failed_reach_the_endpoint(hook, caplog):
    caplog.set_level(logging.DEBUG)
    notifier = Notifier([hook.url()], "myrun", "/runs/myrun")
    assert notifier.started("2 rollout steps") and notifier.finished("last step 1: reward_mean=0.5")
    assert notifier.failed(1, "run failed: trainer rank 0 died (traceback in x)\nsecond line")
    assert [path for path, _ in hook.received] == [f"/hook/{SECRET}"] * 3  # delivered to the URL's own path
    started, finished, failed = hook.messages()
    assert started["type"] == "info" and started["title"] == "relax run myrun started"
    assert "2 rollout steps" in started["message"] and "/runs/myrun" in started["message"]
    assert finished["type"] == "success" and "last step 1: reward_mean=0.5" in finished["message"]
    assert failed["type"] == "failure" and failed["title"] == "relax run myrun failed"
    assert "(exit 1)" in failed["message"] and "trainer rank 0 died" in failed["message"]
    assert "second line" not in failed["message"]
    assert SECRET not in caplog.text and str(hook.port) not in caplog.text  # apprise's own records stay out


def test_several_urls_each_notified(hook):
    second = LocalHook()
    try:
        urls = split_urls(f"{hook.url()}, {second.url('other-secret')}")
        assert len(urls) == 2
        assert Notifier(urls, "r", "/o").started()
        assert len(hook.received) == 1 and len(second.received) == 1
    finally:
        second.close()


def test_failed_delivery_warns_once_and_never_raises(caplog):
    caplog.set_level(logging.DEBUG)
    notifier = Notifier([f"json://127.0.0.1:{_closed_port()}/hook/{SECRET}"], "r", "/o")
    assert notifier.started() is False and notifier.finished() is False and notifier.failed(1, "x") is False
    warnings = [r for r in caplog.records if r.name == "relax.notify" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "json://<redacted>" in warnings[0].getMessage() and "failed" in warnings[0].getMessage()
    debug = [r for r in caplog.records if r.name == "relax.notify" and r.levelno == logging.DEBUG]
    assert len(debug) == 2
    assert SECRET not in caplog.text


def test_unusable_url_is_a_config_error_without_its_secret(caplog):
    with pytest.raises(ConfigError, match=r"--notify-urls: Apprise cannot use URL 2 \(nosuchscheme://<redacted>\)") as err:
        check_urls([f"json://127.0.0.1:9/{SECRET}", f"nosuchscheme://{SECRET}"])
    assert SECRET not in str(err.value) and SECRET not in caplog.text


def test_resolved_config_keeps_schemes_only(tmp_path):
    config = parse_config(["--output-dir", str(tmp_path), "--dry-run", "--notify-urls",
                           f"json://u:{SECRET}@127.0.0.1:9/hook/{SECRET},tgram://{SECRET}/123"])
    assert resolved_values(config)["notify_urls"] == "json://<redacted>,tgram://<redacted>"


def _use_controller(monkeypatch, run_controller):
    """The entrypoint imports run_controller from relax.core.controller when the run starts: a stand-in module
    there (the real one would start Ray)."""
    monkeypatch.setitem(sys.modules, "relax.core.run", types.SimpleNamespace(run_controller=run_controller))


def _fake_controller(code: int, error: str | None):
    def run_controller(config):
        if error:
            logging.getLogger("relax.core.controller").error(error)
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        Path(config.output_dir, "metrics.jsonl").write_text(json.dumps({"step": 0, "rollout/reward_mean": 0.25}) + "\n")
        return code
    return run_controller


@pytest.mark.parametrize("code, error", [(0, None), (1, "run failed: engine 0 stopped answering\ntraceback ..."),
                                         (143, "interrupted by SIGTERM; shutting down")])
def test_entrypoint_wraps_the_controller(hook, tmp_path, monkeypatch, code, error):
    _use_controller(monkeypatch, _fake_controller(code, error))
    out = tmp_path / "out"
    assert main(["--output-dir", str(out), "--notify-urls", hook.url(), "--tb-experiment-name", "exp1"]) == code
    started, last = hook.messages()
    assert started["title"] == "relax run exp1 started"
    if code == 0:
        assert last["type"] == "success" and "last step 0: reward_mean=0.25" in last["message"]
    else:
        assert last["type"] == "failure" and f"(exit {code})" in last["message"]
        assert error.splitlines()[0] in last["message"] and "traceback ..." not in last["message"]


def test_entrypoint_reports_an_exception_escaping_the_controller(hook, tmp_path, monkeypatch):
    def boom(config):
        raise RuntimeError("placement group never ready")

    _use_controller(monkeypatch, boom)
    with pytest.raises(RuntimeError):
        main(["--output-dir", str(tmp_path / "out"), "--notify-urls", hook.url()])
    assert hook.messages()[-1]["type"] == "failure"
    assert "RuntimeError: placement group never ready" in hook.messages()[-1]["message"]


def test_unreachable_endpoint_does_not_change_the_exit_code(tmp_path, monkeypatch, capsys):
    _use_controller(monkeypatch, _fake_controller(0, None))
    url = f"json://127.0.0.1:{_closed_port()}/hook/{SECRET}"
    assert main(["--output-dir", str(tmp_path / "out"), "--notify-urls", url]) == 0


def test_bad_url_stops_before_the_run(tmp_path, monkeypatch, capsys):
    _use_controller(monkeypatch, lambda config: pytest.fail("the run must not start"))
    assert main(["--output-dir", str(tmp_path / "out"), "--notify-urls", f"nosuchscheme://{SECRET}"]) == 2
    err = capsys.readouterr().err
    assert "relax-train: error: --notify-urls: Apprise cannot use URL 1 (nosuchscheme://<redacted>)" in err
    assert SECRET not in err


def test_cli_run_failing_in_preflight_notifies_with_its_error_line(hook, tmp_path, tiny_model):
    """A real relax-train process whose prompt file is broken: the run fails in its checks (before Ray) and the
    endpoint gets 'failed' with that error; the secret is in no output of the run."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(GOOD_PROMPTS + "{broken\n")
    out = tmp_path / "out"
    proc = relax_cli("--hf-checkpoint", tiny_model, "--prompt-data", str(bad), "--input-key", "input",
                     "--rollout-batch-size", "2", "--num-rollout", "1", "--output-dir", str(out),
                     "--notify-urls", hook.url())
    assert proc.returncode == 2, proc.stderr[-2000:]
    started, failed = hook.messages()
    assert started["type"] == "info" and failed["type"] == "failure"
    assert "bad.jsonl:3: malformed JSON" in failed["message"] and "(exit 2)" in failed["message"]
    written = proc.stdout + proc.stderr + "".join(p.read_text() for p in out.rglob("*") if p.is_file())
    assert SECRET not in written
    assert yaml.safe_load((out / "resolved_config.yaml").read_text())["notify_urls"] == "json://<redacted>"


def test_argv_is_redacted_once_parsed(hook, tmp_path, monkeypatch):
    """ClearML stores the command line of a `python -m` run and Ray the driver's: both read sys.argv."""
    argv = ["relax-train", "--output-dir", str(tmp_path / "out"), f"--notify-urls={hook.url()}"]
    monkeypatch.setattr(sys, "argv", list(argv))
    seen = []
    _use_controller(monkeypatch, lambda config: seen.append(list(sys.argv)) or 0)
    assert main(argv[1:]) == 0
    assert seen == [argv[:3] + ["--notify-urls=json://<redacted>"]]
    assert redact_command(["x", "--notify-urls", f"json://{SECRET}/a, tgram://{SECRET}/b"]) == \
        ["x", "--notify-urls", "json://<redacted>,tgram://<redacted>"]
