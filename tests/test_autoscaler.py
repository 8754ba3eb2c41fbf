"""The autoscaler (--autoscaler-config): its YAML checked before Ray, its decisions alone, and a burst of requests
against real embedded engines in the engine pool that scales out (the new engine at the current weights) and back
in after the burst, with every request answered; against a fake pool: the scale-out's timeout (late engines
cancelled or removed), the decision and completion times of a row, and the throughput from counter deltas."""

import json
import threading
import time

import pytest
import ray
import requests
import yaml

from relax.wire.auth import auth_headers, engine_api_key
from relax.wire.engine_client import EngineClient
from relax.config import ConfigError, parse_config
from relax.config.autoscaler import AutoscalerConfig, ScaleInPolicy, ScaleOutPolicy, load_autoscaler_config
from relax.rollout.autoscaler import Autoscaler, LoadSample, decide, histogram_intervals, sample_from_metrics
from test_engine_pool import Router, WeightSource, make_pool, perturbed_weights


def _yaml(tmp_path, data, name="autoscaler.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_yaml_defaults_and_errors_name_the_file_and_key(tmp_path):
    cfg = load_autoscaler_config(_yaml(tmp_path, {"max_engines": 4, "scale_out_policy": {"max_delta": 2}}))
    assert cfg.max_engines == 4 and cfg.min_engines == 1 and cfg.scale_out_policy.max_delta == 2
    assert cfg.scale_out_policy.token_usage_threshold == 0.85 and cfg.scale_in_policy.condition_duration_secs == 120
    bad = [({"max_engine": 4}, "max_engine: unknown key"),
           ({"scale_in_policy": {"max_delta": "one"}}, "scale_in_policy.max_delta: expected an integer"),
           ({"min_engines": 3, "max_engines": 2}, "max_engines (2) is below min_engines (3)"),
           ({"scale_out_policy": {"max_delta": 0}}, "scale_out_policy.max_delta: at least 1")]
    for data, message in bad:
        path = _yaml(tmp_path, data)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
            load_autoscaler_config(path)
        assert path in str(err.value)
    with pytest.raises(ConfigError, match="max_engine: unknown key"):  # a run stops at parse time, before Ray
        parse_config(["--output-dir", str(tmp_path / "run"), "--autoscaler-config", _yaml(tmp_path, bad[0][0])])
    with pytest.raises(ConfigError, match="no such file"):
        parse_config(["--output-dir", str(tmp_path / "run"), "--autoscaler-config", str(tmp_path / "missing.yaml")])


def _samples(now, seconds, **load):
    values = dict(engines=1, token_usage=0.0, queue_per_engine=0.0, throughput=100.0) | load
    return [LoadSample(time=now - seconds + i, **values) for i in range(seconds + 1)]


def test_decisions():
    cfg = AutoscalerConfig(max_engines=3, scale_out_cooldown_secs=10, scale_in_cooldown_secs=20,
                           condition_window_secs=60,
                           scale_out_policy=ScaleOutPolicy(condition_duration_secs=5, max_delta=4,
                                                           queue_depth_per_engine=10),
                           scale_in_policy=ScaleInPolicy(condition_duration_secs=10))
    now, never = 1000.0, float("-inf")
    busy = _samples(now, 6, queue_per_engine=25.0)
    d = decide(cfg, busy, 1, now, never, never)
    assert (d.action, d.delta) == ("scale_out", 2)  # the queue asks for 3 engines in all, 2 more
    assert decide(cfg, busy, 3, now, never, never).action == "hold"  # max_engines
    assert decide(cfg, busy, 1, now, now - 5, now - 5).action == "hold"  # cooldown
    assert decide(cfg, _samples(now, 3, queue_per_engine=25.0), 1, now, never, never).action == "hold"  # too short
    idle = _samples(now, 12, token_usage=0.1)
    d = decide(cfg, idle, 2, now, never, never)
    assert (d.action, d.delta) == ("scale_in", 1)
    assert decide(cfg, idle, 1, now, never, never).action == "hold"  # min_engines
    assert decide(cfg, _samples(now, 12, token_usage=0.28), 2, now, never, never).action == "hold"  # projected 0.56
    wobbly = [LoadSample(time=now - 12 + i, engines=2, token_usage=0.1, queue_per_engine=0.0,
                         throughput=100.0 * (i % 2)) for i in range(13)]
    assert decide(cfg, wobbly, 2, now, never, never).action == "hold"  # throughput not steady


def _ttft(counts: dict[str, float]) -> dict[str, float]:
    """An engine's scrape holding SGLang's time-to-first-token histogram with cumulative `counts` by bound."""
    return {f'sglang:time_to_first_token_seconds_bucket{{le="{le}"}}': c for le, c in counts.items()}


def test_a_slow_first_token_across_the_pool_scales_out():
    # Two engines between two scrapes: engine 0 answered 10 requests within 0.5 s, engine 1 answered 10 taking
    # 2-8 s. The pool's p95 reads both intervals summed (20 requests, the 19th in the 2-8 s bucket), not one
    # engine alone, and not the counts since each engine started.
    before = [_ttft({"0.5": 100, "2": 100, "8": 100, "+Inf": 100}), _ttft({"0.5": 5, "2": 5, "8": 5, "+Inf": 5})]
    after = [_ttft({"0.5": 110, "2": 110, "8": 110, "+Inf": 110}), _ttft({"0.5": 5, "2": 5, "8": 15, "+Inf": 15})]

    def sample(now, then):
        return sample_from_metrics(10.0, now, [1.0, 1.0], [histogram_intervals(m, b) for m, b in zip(now, then)])

    slow = sample(after, before)
    assert slow.ttft_p95 == pytest.approx(2 + 6 * 9 / 10) and slow.queue_time_p95 is None
    assert sample(after, [None, None]).ttft_p95 is None  # no earlier scrape: no interval
    # engine 1's counts went down (it restarted): its interval is unknown, engine 0's 10 fast requests remain
    restarted = [after[0], _ttft({"0.5": 1, "2": 1, "8": 1, "+Inf": 1})]
    assert sample(restarted, before).ttft_p95 == pytest.approx(0.5 * 0.95)

    cfg = AutoscalerConfig(max_engines=3, scale_out_policy=ScaleOutPolicy(condition_duration_secs=2,
                                                                          ttft_p95_threshold=5.0))
    window = [LoadSample(time=8.0 + i, engines=2, token_usage=0.1, queue_per_engine=0.0, throughput=1.0,
                         ttft_p95=slow.ttft_p95) for i in range(3)]
    d = decide(cfg, window, 2, 10.0, float("-inf"), float("-inf"))
    assert d.action == "scale_out" and "time to first token" in d.reason, d


@pytest.mark.e2e
def test_a_burst_scales_out_and_back_in(ray_session, tiny_model, tmp_path):
    cfg = AutoscalerConfig(min_engines=1, max_engines=2, scale_out_cooldown_secs=0.5, scale_in_cooldown_secs=1.0,
                           metrics_interval_secs=0.3, evaluation_interval_secs=0.6, condition_window_secs=4,
                           scale_out_policy=ScaleOutPolicy(token_usage_threshold=0.0, queue_depth_per_engine=0,
                                                           condition_duration_secs=0.6, max_delta=1),
                           scale_in_policy=ScaleInPolicy(token_usage_threshold=1e-9, throughput_variance_threshold=1.0,
                                                         condition_duration_secs=1.5, projected_usage_max=1.0))
    router = Router()
    pool = make_pool(tiny_model, tmp_path, router)
    source = WeightSource.remote(perturbed_weights(tiny_model), "3")
    scaler = None
    answers, stop = [], threading.Event()
    try:
        pool.start_initial([None])
        first = pool.urls()[0]
        ray.get(source.push_kept_weights.remote([first]))
        pool.set_weight_version("3", [first])
        pool.weight_source = source
        scaler = Autoscaler(cfg, pool, scale_out_timeout_s=180, partial_policy="rollback_all", drain_timeout_s=30,
                            log_path=str(tmp_path / "autoscaler.jsonl")).start()

        def burst():  # long answers keep the engine's batch busy
            while not stop.is_set():
                r = requests.post(first + "/generate", timeout=120, headers=auth_headers(engine_api_key()),
                                  json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 64,
                                                                                   "ignore_eos": True}})
                answers.append(r.status_code)

        workers = [threading.Thread(target=burst) for _ in range(3)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 180
        while len(pool.urls()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        stop.set()
        for w in workers:
            w.join(150)
        assert len(pool.urls()) == 2, scaler.status()["decisions"][-3:]
        added = [u for u in pool.urls() if u != first][0]
        assert EngineClient(added, timeout_s=30).get_weight_version() == "3"
        assert ("add", added, "3") in router.log  # it joined the router already serving the current weights
        deadline = time.monotonic() + 60
        while len(pool.urls()) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pool.urls() == [first]  # the newest engine went first
        assert answers and all(code == 200 for code in answers)  # no request of the burst was lost
        deadline = time.monotonic() + 30  # the decision is recorded once the drained engine has stopped
        while time.monotonic() < deadline:
            actions = [d["action"] for d in scaler.status()["decisions"] if d["action"] != "hold"]
            if len(actions) >= 2:
                break
            time.sleep(0.2)
        assert actions == ["scale_out", "scale_in"], actions
        assert (tmp_path / "autoscaler.jsonl").read_text().count("scale_") >= 2
        status_file = tmp_path / "autoscaler_status.json"  # what relax-status shows: the engines, the decisions
        assert _wait(lambda: [d["action"] for d in json.loads(status_file.read_text())["decisions"]
                              if d["action"] != "hold"] == actions, 5)
        (engine,) = json.loads(status_file.read_text())["engines"]
        assert engine["url"] == first and "sglang:token_usage" in engine["metrics"]
    finally:
        stop.set()
        if scaler is not None:
            scaler.stop()
        pool.shutdown()


# ---------------------------------------------------------------- scaling against a fake pool
class FakePool:
    """The pool's interface with engines that are only URLs: `add` takes `add_s` (one value per call, in order)
    and ignores a cancel unless `honour_cancel`; `drain` takes `drain_s`."""

    def __init__(self, add_s=(0.0,), honour_cancel=False, drain_s=0.0):
        self.active, self.removed, self.next = ["http://e0"], [], 1
        self.add_s, self.honour_cancel, self.drain_s = list(add_s), honour_cancel, drain_s
        self.lock = threading.Lock()
        self.seen_scaling = []

    def urls(self):
        with self.lock:
            return list(self.active)

    def list(self):
        return [{"id": int(u.rsplit("e", 1)[1]), "url": u, "state": "active"} for u in self.urls()]

    def add(self, count=1, cancel=None):
        with self.lock:
            seconds = self.add_s.pop(0) if len(self.add_s) > 1 else self.add_s[0]
            url, self.next = f"http://e{self.next}", self.next + 1
        self.seen_scaling.append(self.scaler.status().get("scaling"))
        if seconds == "fail":
            raise RuntimeError("no room for another engine")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.honour_cancel and cancel is not None and cancel.is_set():
                raise RuntimeError("cancelled")
            time.sleep(0.01)
        with self.lock:
            self.active.append(url)
        return [url]

    def remove(self, url):
        with self.lock:
            self.active.remove(url)
            self.removed.append(url)

    def drain(self, url, timeout_s):
        time.sleep(self.drain_s)
        self.remove(url)
        return True


def _scaler(pool, tmp_path=None, policy="rollback_all", timeout_s=0.5):
    scaler = Autoscaler(AutoscalerConfig(max_engines=4), pool, scale_out_timeout_s=timeout_s, partial_policy=policy,
                        drain_timeout_s=1, log_path=str(tmp_path / "autoscaler.jsonl") if tmp_path else None)
    pool.scaler = scaler
    return scaler


def _wait(test, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not test() and time.monotonic() < deadline:
        time.sleep(0.05)
    return test()


@pytest.mark.parametrize("policy", ["rollback_all", "keep_partial"])
def test_scale_out_returns_at_its_timeout_and_a_late_engine_leaves(policy):
    from relax.rollout.autoscaler import Decision

    pool = FakePool(add_s=(2.0,))
    scaler = _scaler(pool, policy=policy)
    t0 = time.monotonic()
    scaler._scale_out(Decision("scale_out", 1, "test"))
    assert time.monotonic() - t0 < 1.2  # --scale-out-timeout 0.5 s, not the 2 s the start takes
    (row,) = scaler.decisions
    assert row["late"] == 1 and row["delta"] == 0
    assert row["action"] == ("scale_out_rolled_back" if policy == "rollback_all" else "scale_out")
    # the engine came up at 2 s all the same (this pool ignores the cancel): it is removed as it does
    assert _wait(lambda: pool.removed == ["http://e1"])
    assert pool.urls() == ["http://e0"]
    assert scaler.decisions[-1]["action"] == "scale_out_late_removed"


def test_scale_out_keep_partial_keeps_the_engines_in_time_and_removes_the_late_one():
    from relax.rollout.autoscaler import Decision

    pool = FakePool(add_s=(0.05, 2.0))
    scaler = _scaler(pool, policy="keep_partial")
    scaler._scale_out(Decision("scale_out", 2, "test"))
    assert _wait(lambda: pool.removed == ["http://e2"])
    assert pool.urls() == ["http://e0", "http://e1"]
    (row, late) = scaler.decisions
    assert (row["action"], row["delta"], row["urls"], row["late"]) == ("scale_out", 1, ["http://e1"], 1)
    assert (late["action"], late["urls"]) == ("scale_out_late_removed", ["http://e2"])


def test_scale_out_rollback_all_gives_up_at_the_first_failure():
    from relax.rollout.autoscaler import Decision

    pool = FakePool(add_s=(1.0, "fail", 5.0), honour_cancel=True)
    scaler = _scaler(pool, timeout_s=30)
    t0 = time.monotonic()
    scaler._scale_out(Decision("scale_out", 3, "test"))
    assert time.monotonic() - t0 < 3.0  # not the 5 s start of the third, nor the 30 s timeout
    (row,) = scaler.decisions
    assert (row["action"], row["failed"], row["late"]) == ("scale_out_rolled_back", 1, 2)
    time.sleep(1.5)
    assert pool.urls() == ["http://e0"]


def test_a_decision_row_has_the_time_it_was_decided_and_when_it_was_done(tmp_path):
    import json

    from relax.rollout.autoscaler import Decision

    pool = FakePool(add_s=(0.4,), drain_s=0.4)
    scaler = _scaler(pool, tmp_path, timeout_s=10)
    t0 = time.time()
    scaler._scale_out(Decision("scale_out", 1, "busy"))
    scaler._scale_in(Decision("scale_in", 1, "idle"))
    out, inn = scaler.decisions
    assert out["time"] - t0 < 0.2 and out["done_time"] - out["time"] >= 0.4 and out["duration_s"] >= 0.4
    assert pool.seen_scaling[0]["action"] == "scale_out" and scaler.status()["scaling"] is None
    assert inn["time"] - out["done_time"] < 0.2 and inn["done_time"] - inn["time"] >= 0.4
    assert (out["action"], out["delta"], out["engines"]) == ("scale_out", 1, 2)
    assert (inn["action"], inn["delta"], inn["engines"]) == ("scale_in", -1, 1)
    rows = [json.loads(line) for line in (tmp_path / "autoscaler.jsonl").read_text().splitlines()]
    assert rows == [out, inn]


def test_throughput_is_the_counter_delta_between_the_autoscalers_own_scrapes(monkeypatch):
    import relax.rollout.autoscaler as autoscaler

    counters = {"http://e0": 1000.0}

    def scrape(url, api_key=None, timeout_s=5.0):
        # another reader (the metrics service) keeps the gauge at 0; the counter is cumulative
        return {'sglang:generation_tokens_total{model_name="m"}': counters[url],
                'sglang:gen_throughput{model_name="m"}': 0.0, "sglang:token_usage": 0.5}

    monkeypatch.setattr(autoscaler, "scrape_engine_metrics", scrape)
    scaler = _scaler(FakePool())
    assert scaler.observe().throughput is None  # a first scrape: no rate yet
    time.sleep(0.2)
    counters["http://e0"] += 100
    tput = scaler.observe().throughput
    assert 100 / 0.5 < tput < 100 / 0.19
    counters["http://e0"] = 5.0  # the engine restarted: its counter went down
    assert scaler.observe().throughput is None
    time.sleep(0.1)
    counters["http://e0"] += 20
    assert scaler.observe().throughput > 0


def test_throughput_meter():
    from relax.rollout.autoscaler import ThroughputMeter

    meter = ThroughputMeter()
    gen = "sglang:generation_tokens_total"
    assert meter.rates({"a": (0.0, {gen: 10.0}), "b": (0.0, {"sglang:gen_throughput": 7.0})}) == {"a": None, "b": 7.0}
    assert meter.rates({"a": (2.0, {gen: 30.0}), "c": (2.0, {gen: 5.0})}) == {"a": 10.0, "c": None}
    assert meter.rates({"c": (3.0, {gen: 9.0})}) == {"c": 4.0}
    assert meter.rates({"a": (4.0, {gen: 50.0})}) == {"a": None}  # not read last time: starts afresh


def test_scale_out_on_the_engine_pool_cancels_a_start_past_the_timeout(ray_session):
    from relax.rollout.autoscaler import Decision
    from test_engine_pool import assert_actor_gone, slow_start_pool

    pool, router, actors, server = slow_start_pool()
    scaler = Autoscaler(AutoscalerConfig(max_engines=2), pool, scale_out_timeout_s=1.0,
                        partial_policy="keep_partial", drain_timeout_s=1)
    try:
        t0 = time.monotonic()
        scaler._scale_out(Decision("scale_out", 1, "test"))
        assert time.monotonic() - t0 < 3.0
        assert scaler.decisions[-1]["late"] == 1
        assert _wait(lambda: pool.list() == [])  # the pool abandoned the start: the actor is killed
        assert_actor_gone(actors[0], timeout_s=10)
        assert router.log == [] and [e["kind"] for e in pool.events] == ["engine_add_abandoned"]
    finally:
        pool.shutdown()
        server.shutdown()
