"""--colocate / --offload-train / --offload-rollout / --balance-data end to end through the controller on CPU (real
Ray, Megatron-core over gloo with 2 data-parallel ranks, 2 embedded engines behind the router, TransferQueue).

- a plain run is the reference: same seeds, so the same rollouts and losses are expected bit for bit;
- --colocate: engines and trainer ranks share bundles; every step the engines release their memory before the
  update, resume their weights for the push (KV cache still released), then resume the KV cache, while the
  trainer ranks offload (resident memory measured) and reload. The engines' event logs show that order, the
  rollouts (served by the pushed weights) and the losses equal the plain run's;
- --offload-train alone, --offload-rollout alone (with --update-weights-interval 2: a step without a push
  releases only the KV cache), and --colocate --balance-data (token spread across ranks shrinks).
"""

import json

import pytest
import ray

from conftest import shared_ray, shared_tiny_model

from relax.backends.engine_client import EngineClient
from relax.config import parse_config
from relax.config.errors import ConfigError
from relax.core.controller import Controller
from relax.models.tasks import generate_task_dataset

pytestmark = pytest.mark.e2e  # whole runs: Ray, trainer, engines (deselect with -m 'not e2e')

RUNS: dict = {}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("colocate")
    model = shared_tiny_model()
    data = generate_task_dataset(base / "train.jsonl", 40, seed=0, task="add_mod10")
    return base, str(model), str(data)


def _argv(assets, name, steps, *extra):
    base, model, data = assets
    out = base / name
    return ["--hf-checkpoint", model, "--prompt-data", data, "--apply-chat-template", "--input-key", "input",
            "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "6", "--micro-batch-size", "2", "--lr", "1e-2", "--num-rollout", str(steps),
            "--resource", '{"actor": [1, 2], "rollout": [1, 2]}', "--num-data-storage-units", "1",
            "--output-dir", str(out), "--distributed-backend", "gloo",
            "--save-debug-rollout-data", str(out / "rollouts" / "{rollout_id}.jsonl"), *extra]


def _run(assets, name, steps, *extra):
    """Run the controller; return the metrics by step, the rollouts by step, and each engine's event log."""
    config = parse_config(_argv(assets, name, steps, *extra))
    shared_ray()
    controller = Controller(config)
    try:
        controller.start()
        controller.run()
        events = [EngineClient(u).server_info().get("memory_events", []) for u in controller.engine_urls]
        checksum = ray.get(controller.workers[0].weights_checksum.remote())  # usable again after the loop
    finally:
        controller.shutdown()
    out = assets[0] / name
    metrics = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    rollouts = {}
    for step in range(steps):
        rows = [json.loads(line) for line in (out / "rollouts" / f"{step}.jsonl").read_text().splitlines()[1:]]
        rollouts[step] = [(r["prompt_tokens"], r["response_tokens"], r["reward"]) for r in rows]
    return {"metrics": metrics, "rollouts": rollouts, "events": events, "checksum": checksum}


def _plain(assets):
    if "plain" not in RUNS:
        RUNS["plain"] = _run(assets, "plain", 2)
    return RUNS["plain"]


def _same_training(run, plain, steps):
    for step in steps:
        assert run["rollouts"][step] == plain["rollouts"][step], step
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
            assert run["metrics"][step][key] == plain["metrics"][step][key], (step, key)


def _phases(events):
    """The engine's events as (kind, tags), consecutive weight updates (buckets) collapsed into one."""
    out = []
    for e in events:
        item = (e["event"], tuple(e["tags"]))
        if not (item[0] == "update_weights" and out and out[-1][0] == "update_weights"):
            out.append(item)
    return out


def test_colocate_protocol_order_and_exactness(assets):
    plain = _plain(assets)
    run = _run(assets, "colocate", 2, "--colocate")
    _same_training(run, plain, range(2))  # offload + reload leave the trainer bit-identical
    assert run["checksum"] == plain["checksum"]  # the same final weights, read after the loop
    one_step = [("release", ("kv_cache", "weights")), ("resume", ("weights",)), ("update_weights", ()),
                ("resume", ("kv_cache",))]
    assert len(run["events"]) == 2
    for events in run["events"]:
        assert _phases(events) == one_step * 2
        updates = [e for e in events if e["event"] == "update_weights"]
        # weights were pushed while the KV cache was still released, one version per step
        assert all(e["memory_released"] == ["kv_cache"] for e in updates)
        assert sorted({e["weight_version"] for e in updates}) == ["1", "2"]
        times = [e["time"] for e in events]
        assert times == sorted(times) and [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    # a plain run never releases or resumes
    assert len(plain["events"]) == 2 and all(e["event"] == "update_weights" for ev in plain["events"] for e in ev)
    for step in range(2):
        m = run["metrics"][step]
        assert m["offload/train_bytes"] > 0 and m["perf/engine_release_time"] >= 0
        print(f"\nstep {step}: trainer rank 0 RSS before offload {m['offload/train_rss_before'] / 2**20:.1f} MiB, "
              f"after {m['offload/train_rss_after'] / 2**20:.1f} MiB ({m['offload/train_bytes'] / 2**20:.1f} MiB "
              "offloaded)")
        assert m["offload/train_rss_after"] < m["offload/train_rss_before"]


def test_offload_train_alone(assets):
    plain = _plain(assets)
    run = _run(assets, "offload_train", 1, "--offload-train")
    _same_training(run, plain, [0])  # offloaded before the rollout, reloaded before the update
    assert all(e["event"] == "update_weights" for ev in run["events"] for e in ev)  # engines keep their memory
    assert run["metrics"][0]["offload/train_bytes"] > 0


def test_offload_rollout_alone_with_sparse_weight_updates(assets):
    plain = _plain(assets)
    run = _run(assets, "offload_rollout", 2, "--offload-rollout", "--update-weights-interval", "2")
    _same_training(run, plain, [0])  # step 1 differs: the plain run pushed weights after step 0
    assert "offload/train_bytes" not in run["metrics"][0]
    for events in run["events"]:
        # step 0 pushes nothing: only the KV cache is released (the weights stay, nothing would refill them)
        assert _phases(events) == [("release", ("kv_cache",)), ("resume", ("kv_cache",)),
                                   ("release", ("kv_cache", "weights")), ("resume", ("weights",)),
                                   ("update_weights", ()), ("resume", ("kv_cache",))]


def test_colocate_balance_data_shrinks_token_spread(assets):
    # prompts alternate short and long, one sample each: the strided split gives rank 0 the short ones
    path = assets[0] / "uneven.jsonl"
    rows = [{"input": "1+1=" if i % 2 == 0 else "what is " + "seven plus " * (3 + i) + "one?", "label": "2"}
            for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = _run((assets[0], assets[1], str(path)), "balanced", 1, "--colocate", "--balance-data",
               "--calculate-per-token-loss", "--rollout-batch-size", "8", "--n-samples-per-prompt", "1",
               "--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages")
    m = run["metrics"][0]
    spread, strided = m["train/dp_token_spread"], m["train/dp_token_spread_strided"]
    print(f"\ntoken spread across 2 DP ranks (max - min tokens): strided {strided:.1f}, balanced {spread:.1f}")
    assert strided > 50 and spread < strided / 4, (spread, strided)
    assert m["offload/train_bytes"] > 0 and m["train/loss"] == m["train/loss"]


def test_parse_rules():
    base = ["--hf-checkpoint", "x", "--rollout-batch-size", "2"]
    with pytest.raises(ConfigError, match="--balance-data works only in colocated mode"):
        parse_config(base + ["--balance-data"])
    with pytest.raises(ConfigError, match="cannot exceed actor"):
        parse_config(base + ["--colocate", "--resource", '{"actor": [1, 1], "rollout": [1, 2]}'])
    with pytest.raises(ConfigError, match="--rollout-external"):
        parse_config(base + ["--colocate", "--rollout-external", "--rollout-external-engine-addrs", "h:1"])
    c = parse_config(base + ["--colocate"])
    assert c.offload and c.offload_train and c.offload_rollout
    c = parse_config(base + ["--offload-train"])
    assert c.offload_train and not c.offload_rollout
