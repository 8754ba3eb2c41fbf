"""The autoscaler (--autoscaler-config): its YAML checked before Ray, its decisions alone, and a burst of requests
against real embedded engines in the engine pool that scales out (the new engine at the current weights) and back
in after the burst, with every request answered."""

import threading
import time

import pytest
import ray
import requests
import yaml

from relax.backends.auth import auth_headers, engine_api_key
from relax.backends.engine_client import EngineClient
from relax.config import ConfigError, parse_config
from relax.config.autoscaler import AutoscalerConfig, ScaleInPolicy, ScaleOutPolicy, load_autoscaler_config
from relax.rollout.autoscaler import Autoscaler, LoadSample, decide
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
    finally:
        stop.set()
        if scaler is not None:
            scaler.stop()
        pool.shutdown()
