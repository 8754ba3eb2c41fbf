"""The metrics service (relax/observability/metrics_service.py) and its client (metrics_client.py): reports from
Ray actors standing in for roles and from the driver, scraped over HTTP as Prometheus text and JSON; the
reporter's no-op and non-blocking behaviour; the Prometheus text parser and the engine scraper."""

import json
import math
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import ray
import requests

from conftest import assert_ray_released
from relax.wire.auth import engine_api_key
from relax.config.support_ops import OPS_FEATURES
from relax.observability.metrics_client import (
    MetricsReporter,
    metric_key,
    parse_prometheus_text,
    scrape_engine_metrics,
    split_metric_key,
)
from relax.observability.metrics_service import (
    SERVICE_NAME,
    URL_FILE,
    MetricsService,
    MetricsStore,
    prometheus_name,
    start_metrics_service,
    stop_metrics_service,
)

# What SGLang's /metrics looks like (prometheus_client output, with --enable-metrics): HELP/TYPE lines,
# labelled gauges, a histogram with `le` buckets including +Inf, and a counter.
SGLANG_SAMPLE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="qwen",tp_rank="0"} 3.0
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{engine_type="unified",model_name="qwen",tp_rank="0"} 1234.5
# HELP sglang:e2e_request_latency_seconds Histogram of End-to-end request latency in seconds
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_sum{model_name="qwen"} 12.5
sglang:e2e_request_latency_seconds_bucket{le="0.1",model_name="qwen"} 0.0
sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="qwen"} 7.0
sglang:e2e_request_latency_seconds_count{model_name="qwen"} 7.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="qwen"} 4096.0 1700000000000
sglang:odd_label{path="a\\\\b \\"q\\", x",model_name="qwen"} NaN
"""

SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^{}]*\})? (\S+)$')


def check_exposition(text: str) -> dict[str, list]:
    """Strict checks of Prometheus text format on `text`; returns {family: [sample lines]}. Every sample line
    is `name{labels} value`, its family's `# TYPE` line came first (once), every name is valid."""
    assert text.endswith("\n")
    typed: dict[str, str] = {}
    samples: dict[str, list] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name), name
            assert name not in typed, f"second TYPE line for {name}"
            assert kind in ("gauge", "counter")
            typed[name] = kind
            continue
        if line.startswith("#"):
            assert line.startswith("# HELP "), line
            continue
        match = SAMPLE_RE.match(line)
        assert match, f"not `name{{labels}} value`: {line!r}"
        name = match.group(1)
        assert name.startswith("relax_")
        assert name in typed, f"sample before its TYPE line: {line!r}"
        float(match.group(3))
        samples.setdefault(name, []).append(line)
    return samples


@ray.remote(num_cpus=0.1)
class FakeRole:
    """Stands in for a role (trainer rank, rollout manager): reports through the real MetricsReporter."""

    def __init__(self, role: str, rank: int):
        self.role, self.rank = role, rank
        self.reporter = MetricsReporter(True)

    def step(self, step: int, metrics: dict) -> float:
        t0 = time.perf_counter()
        sent = self.reporter.report(self.role, self.rank, metrics, step=step)
        assert sent
        return time.perf_counter() - t0


@pytest.fixture
def service(ray_session, tmp_path):
    actor, url = start_metrics_service(tmp_path)
    try:
        yield actor, url, tmp_path
    finally:
        stop_metrics_service(actor)
        assert_ray_released()


def scrape(url: str) -> str:
    resp = requests.get(url + "/metrics", timeout=10)
    assert resp.status_code == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return resp.text


def test_roles_report_and_http_serves_prometheus_json_and_steps(service):
    actor, url, out = service
    assert (out / URL_FILE).read_text().strip() == url
    assert url.startswith("http://127.0.0.1:")  # one node: loopback only
    roles = [FakeRole.remote("trainer", 0), FakeRole.remote("trainer", 1)]
    try:
        for step in range(3):
            ray.get([r.step.remote(step, {"train/loss": 1.0 / (step + 1) + rank, "train/grad_norm": 2.0,
                                           "train/kl": [0.1, 0.2, 0.3]}) for rank, r in enumerate(roles)])
            driver = MetricsReporter(True)
            driver.report("rollout", 0, {"rollout/reward_mean": 0.5 * step, "rollout/note": "text"}, step=step)
            record = driver.step_record(step, expect={"trainer": 2, "rollout": 1}, timeout_s=30)
            assert set(record["sources"]) == {"trainer/0", "trainer/1", "rollout/0"}
            # merged: the first rank's value of a name reported by several ranks
            assert record["metrics"]["train/loss"] == pytest.approx(1.0 / (step + 1))
            assert record["sources"]["trainer/1"]["train/loss"] == pytest.approx(1.0 / (step + 1) + 1)
            assert record["metrics"]["rollout/reward_mean"] == 0.5 * step

            text = scrape(url)  # scraped while the "run" goes on
            samples = check_exposition(text)
            losses = samples["relax_train_loss"]
            assert f'relax_train_loss{{role="trainer",rank="0",step="{step}"}} {1.0 / (step + 1)!r}' in losses
            assert len(losses) == 2
        driver.report("engine", 0, {"engine/num_running_reqs": 3})  # no step: current values only
        driver.flush()
    finally:
        for r in roles:
            ray.kill(r)

    text = scrape(url)
    samples = check_exposition(text)
    assert samples["relax_engine_num_running_reqs"] == ['relax_engine_num_running_reqs{role="engine",rank="0"} 3.0']
    assert samples["relax_train_kl_p90"][0].startswith('relax_train_kl_p90{role="trainer",rank="0",step="2"} ')
    assert "relax_rollout_note" not in samples  # strings are JSON-only
    assert 'relax_metrics_service_reports_total{role="trainer"} 6' in text

    # an independent parser reads it back (prometheus_client's, as Prometheus itself would)
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    loss = {(s.labels["rank"]): s.value for s in families["relax_train_loss"].samples}
    assert loss == {"0": pytest.approx(1 / 3), "1": pytest.approx(1 / 3 + 1)}
    ours, types = parse_prometheus_text(text)
    assert types["relax_train_loss"] == "gauge"
    assert len(ours) == sum(len(v) for v in samples.values())

    current = requests.get(url + "/metrics.json", timeout=10).json()
    assert current["latest_step"] == 2
    by_key = {(e["role"], e["rank"], e["name"]): e for e in current["current"]}
    assert by_key[("trainer", "1", "train/loss")]["step"] == 2
    assert by_key[("rollout", "0", "rollout/note")]["value"] == "text"
    assert by_key[("trainer", "0", "train/kl")]["value"] == [0.1, 0.2, 0.3]

    steps = requests.get(url + "/steps?since=1", timeout=10).json()
    assert [s["step"] for s in steps["steps"]] == [1, 2]
    assert steps["steps"][0]["metrics"]["rollout/reward_mean"] == 0.5
    assert [s["step"] for s in requests.get(url + "/steps", timeout=10).json()["steps"]] == [0, 1, 2]
    assert [s["step"] for s in requests.get(url + "/steps?since=0&limit=1", timeout=10).json()["steps"]] == [0]
    assert requests.get(url + "/steps?since=x", timeout=10).status_code == 400
    assert requests.get(url + "/nothing", timeout=10).status_code == 404
    assert requests.get(url + "/health", timeout=10).text == "ok\n"


class SlowService(MetricsService):
    """A service that takes 0.2 s per report: the callers must not feel it."""

    def report(self, *args, **kwargs):
        time.sleep(0.2)
        super().report(*args, **kwargs)


def test_report_never_waits_for_a_slow_service(ray_session):
    actor, _ = start_metrics_service(None, name="relax-metrics-slow", cls=SlowService)
    try:
        reporter = MetricsReporter(True, name="relax-metrics-slow")
        reporter.report("trainer", 0, {"warm": 1.0})  # the one-time look-up of the actor
        t0 = time.perf_counter()
        for i in range(10):
            assert reporter.report("trainer", 0, {"i": float(i)}, step=i)
        elapsed = time.perf_counter() - t0
        assert elapsed < 0.5, f"10 reports took {elapsed:.2f}s (the service needs 2 s for them)"
        t0 = time.perf_counter()
        reporter.flush()
        assert time.perf_counter() - t0 > 1.0  # they really were still being processed
        # every report arrived, in order
        values = {(e["name"]): e["value"] for e in ray.get(actor.current.remote())}
        assert values["i"] == 9.0
        assert [s["step"] for s in ray.get(actor.steps.remote())] == list(range(10))

        # a service that falls behind by `max_pending` reports: new ones are dropped, the caller still does not wait
        bounded = MetricsReporter(True, name="relax-metrics-slow", max_pending=3)
        t0 = time.perf_counter()
        sent = [bounded.report("rollout", 0, {"j": float(j)}) for j in range(8)]
        assert time.perf_counter() - t0 < 0.5
        assert sent[:3] == [True] * 3 and not all(sent[3:])
        assert bounded.dropped == sent.count(False)
        bounded.flush()
    finally:
        stop_metrics_service(actor)
    assert_ray_released()


def test_reporter_is_a_no_op_when_disabled(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a disabled reporter must not look for the service")

    monkeypatch.setattr(ray, "get_actor", fail)
    reporter = MetricsReporter.from_config(type("C", (), {"use_metrics_service": False})())
    assert not reporter.enabled
    assert reporter.report("trainer", 0, {"train/loss": 1.0}, step=0) is False
    assert reporter.step_record(0) is None
    reporter.flush()


def test_reporter_without_a_service_drops_quietly(ray_session):
    reporter = MetricsReporter(True, name="relax-metrics-never-started")
    assert reporter.report("trainer", 0, {"train/loss": 1.0}, step=0) is False
    assert reporter.report("trainer", 0, {"train/loss": 1.0}, step=1) is False  # no second look-up for 5 s
    assert reporter.dropped == 2
    assert reporter.step_record(0, timeout_s=1) is None


class _FakeEngine(BaseHTTPRequestHandler):
    key: str | None = None

    def do_GET(self):  # noqa: N802
        if self.path != "/metrics" or (self.key and self.headers.get("Authorization") != f"Bearer {self.key}"):
            self.send_response(401)
            self.end_headers()
            return
        body = SGLANG_SAMPLE.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_engine():
    handler = type("Engine", (_FakeEngine,), {"key": engine_api_key() or "secret"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.key
    finally:
        server.shutdown()
        server.server_close()


def test_parse_prometheus_text_reads_an_sglang_sample():
    samples, types = parse_prometheus_text(SGLANG_SAMPLE)
    assert types["sglang:e2e_request_latency_seconds"] == "histogram"
    assert types["sglang:prompt_tokens_total"] == "counter"
    by_key = {metric_key(s.name, s.labels): s.value for s in samples}
    assert by_key['sglang:num_running_reqs{engine_type="unified",model_name="qwen",tp_rank="0"}'] == 3.0
    assert by_key['sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="qwen"}'] == 7.0
    assert by_key['sglang:prompt_tokens_total{model_name="qwen"}'] == 4096.0  # the timestamp is not the value
    odd = [s for s in samples if s.name == "sglang:odd_label"][0]
    assert odd.labels == {"path": 'a\\b "q", x', "model_name": "qwen"} and math.isnan(odd.value)
    for bad in ("9bad 1", "x{a=1} 2", 'x{a="1"', "x 1 2 3", "x abc", 'x{a="1"}2'):
        with pytest.raises(ValueError):
            parse_prometheus_text(bad)
    # the keys round-trip to (name, labels), and plain names stay plain
    key = metric_key(odd.name, odd.labels)
    assert split_metric_key(key) == (odd.name, odd.labels)
    assert split_metric_key("train/loss") == ("train/loss", {})
    assert split_metric_key("a{b") == ("a{b", {})


def test_scrape_engine_metrics_sends_the_key(fake_engine):
    url, key = fake_engine
    values = scrape_engine_metrics(url, key)
    assert values['sglang:gen_throughput{engine_type="unified",model_name="qwen",tp_rank="0"}'] == 1234.5
    assert len(values) == 8
    with pytest.raises(requests.HTTPError):
        scrape_engine_metrics(url, "wrong")


def test_service_watches_an_engine(service, fake_engine):
    actor, url, _ = service
    engine_url, _ = fake_engine
    reporter = MetricsReporter(True)
    assert reporter.watch_engine("engine", 0, engine_url)  # first scrape at once, with the run's key
    assert reporter.watch_engine("engine", 1, "http://127.0.0.1:9")  # nothing there: counted, not fatal
    reporter.flush()
    assert not MetricsReporter(False).watch_engine("engine", 2, engine_url)
    text = scrape(url)
    samples = check_exposition(text)
    assert ('relax_sglang:num_running_reqs{role="engine",rank="0",engine_type="unified",model_name="qwen",'
            'tp_rank="0"} 3.0') in samples["relax_sglang:num_running_reqs"]
    assert len(samples["relax_sglang:e2e_request_latency_seconds_bucket"]) == 2
    assert 'relax_metrics_service_scrape_errors_total{role="engine",rank="1"} 1' in text
    # NaN is valid Prometheus text, and JSON answers carry it as null
    assert samples["relax_sglang:odd_label"][0].endswith(" NaN")
    current = json.loads(requests.get(url + "/metrics.json", timeout=10).text)
    odd = [e for e in current["current"] if e["name"].startswith("sglang:odd_label")]
    assert odd[0]["value"] is None


def test_store_names_and_collisions():
    assert prometheus_name("train/loss") == "relax_train_loss"
    assert prometheus_name("perf/tokens-per.s") == "relax_perf_tokens_per_s"
    assert prometheus_name("9lives") == "relax_9lives"
    store = MetricsStore(keep_steps=2)
    # `a/b` and `a_b` export as one name: one series is kept, so the text stays valid
    store.report("trainer", "0", {"a/b": 1.0, "a_b": 2.0, "flag": True, "metrics_service_reports_total": 5.0},
                 step=0)
    store.report("trainer", "0", {"x": 1.0}, step=1)
    store.report("trainer", "0", {"x": 2.0}, step=2)
    samples = check_exposition(store.prometheus_text())
    assert len(samples["relax_a_b"]) == 1
    assert samples["relax_flag"] == ['relax_flag{role="trainer",rank="0",step="0"} 1.0']
    assert [s["step"] for s in store.steps()] == [1, 2]  # keep_steps: the oldest step is dropped
    assert store.step_record(0) is None


def test_watched_engines_are_scraped_again_and_again(ray_session):
    actor, url = start_metrics_service(None, name="relax-metrics-fast", scrape_interval_s=0.2)
    try:
        ray.get(actor.watch.remote("engine", 0, "http://127.0.0.1:9"))
        deadline = time.monotonic() + 20
        errors = 0.0
        while time.monotonic() < deadline and errors < 3:
            time.sleep(0.3)
            samples, _ = parse_prometheus_text(scrape(url))
            errors = sum(s.value for s in samples if s.name == "relax_metrics_service_scrape_errors_total")
        assert errors >= 3  # the first scrape, then the background thread's
        ray.get(actor.unwatch.remote("engine", 0))
    finally:
        stop_metrics_service(actor)
    assert_ray_released()


@pytest.mark.e2e
@pytest.mark.skipif("use_metrics_service" not in OPS_FEATURES,
                    reason="--use-metrics-service is refused until the controller and roles report to the service")
def test_a_run_is_scraped_while_it_runs(tmp_path, tiny_model):
    """A whole run with --use-metrics-service: /metrics is scraped while it runs, and metrics.jsonl holds the
    records the service merged (the controller's metrics come from it)."""
    from conftest import run_steps
    from relax.config import parse_config
    from relax.models.tasks import generate_task_dataset

    data = generate_task_dataset(tmp_path / "train.jsonl", 16, seed=0, task="add_mod10")
    out = tmp_path / "run"
    config = parse_config([
        "--hf-checkpoint", tiny_model, "--prompt-data", str(data), "--apply-chat-template", "--input-key", "input",
        "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--num-rollout", "3", "--rollout-max-response-len", "3", "--micro-batch-size", "4",
        "--resource", '{"actor": [1, 1], "rollout": [1, 1]}', "--output-dir", str(out),
        "--distributed-backend", "gloo", "--use-metrics-service",
    ])
    scraped: list[str] = []
    stop = threading.Event()

    def scraper():
        while not stop.wait(0.2):
            try:
                url = (out / URL_FILE).read_text().strip()
                scraped.append(requests.get(url + "/metrics", timeout=5).text)
            except (OSError, requests.RequestException):
                pass

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    try:
        records = run_steps(config)
    finally:
        stop.set()
        thread.join(10)
    assert [r["step"] for r in records] == [0, 1, 2]
    during = [t for t in scraped if "relax_train_loss{" in t]
    assert during, f"no scrape during the run saw a trainer report ({len(scraped)} scrapes)"
    for text in during:
        check_exposition(text)
    steps_seen = {int(m) for t in during for m in re.findall(r'relax_train_loss\{role="trainer",rank="0",step="(\d+)"', t)}
    assert steps_seen and steps_seen <= {0, 1, 2}
    last = during[-1]
    for family in ("relax_rollout_reward_mean", "relax_perf_step_time", "relax_data_put_samples"):
        assert family + "{" in last, family
    # the merged record is what the controller logged: the roles' values and the controller's own
    for record in records:
        assert record["data/put_samples"] == 4.0
        assert "train/loss" in record and "perf/step_time" in record
    with pytest.raises(ValueError):  # the service went with the run
        ray.get_actor(SERVICE_NAME)
