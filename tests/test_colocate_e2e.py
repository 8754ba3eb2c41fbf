"""--colocate / --offload-train / --offload-rollout / --balance-data end to end through the controller on CPU (real
Ray, Megatron-core over gloo with 2 data-parallel ranks, 2 embedded engines behind the router, TransferQueue).

Every run starts the same way (that start, not its sub-second steps, is what a run costs), so the runs are few and
each proves several things. Three runs share seeds, data and --update-weights-interval 2 over 3 steps (step 0
rolls out without a push, step 1 pushes, step 2 is rolled out by the pushed weights), so the same rollouts and
losses are expected bit for bit in all three:

- --offload-train alone: the trainer ranks offload and reload, the engines keep their memory (only weight
  updates in their event logs);
- --offload-rollout alone: the engines release their memory (only the KV cache on a step without a push, the
  weights too before a push), the trainer is not offloaded. These two runs differ from a plain run in disjoint
  parts (trainer vs engines), so their being equal at every step, optimizer state included (steps 1 and 2),
  shows each of them exact: no plain run is needed as a reference;
- --colocate: engines and trainer ranks share bundles; the engines release before the update, resume their
  weights for the push (KV cache still released), then resume the KV cache, while the trainer ranks offload
  (resident memory measured) and reload. The engines' event logs show that order, the rollouts (step 2 served
  by the pushed weights) and the losses equal the other two runs';
- --colocate --balance-data (its own data and split: the token spread across ranks shrinks).
"""

import json

import pytest
import ray

from conftest import shared_ray

from relax.wire.engine_client import EngineClient
from relax.config import parse_config
from relax.config.errors import ConfigError
from relax.core.controller import Controller

pytestmark = pytest.mark.e2e  # whole runs: Ray, trainer, engines (deselect with -m 'not e2e')

RUNS: dict = {}


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


STEPS = 3
SPARSE = ("--update-weights-interval", "2")  # step 0 pushes nothing, step 1 pushes, step 2 uses the pushed weights


def _cached(assets, name, *flags):
    if name not in RUNS:
        RUNS[name] = _run(assets, name, STEPS, *flags, *SPARSE)
    return RUNS[name]


def _offload_train(assets):
    return _cached(assets, "offload_train", "--offload-train")


def _offload_rollout(assets):
    return _cached(assets, "offload_rollout", "--offload-rollout")


def _same_training(run, reference, steps):
    for step in steps:
        assert run["rollouts"][step] == reference["rollouts"][step], step
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
            assert run["metrics"][step][key] == reference["metrics"][step][key], (step, key)


def _phases(events):
    """The engine's events as (kind, tags), consecutive weight updates (buckets) collapsed into one."""
    out = []
    for e in events:
        item = (e["event"], tuple(e["tags"]))
        if not (item[0] == "update_weights" and out and out[-1][0] == "update_weights"):
            out.append(item)
    return out


NO_PUSH_STEP = [("release", ("kv_cache",)), ("resume", ("kv_cache",))]
PUSH_STEP = [("release", ("kv_cache", "weights")), ("resume", ("weights",)), ("update_weights", ()),
             ("resume", ("kv_cache",))]


def test_offload_train_alone(assets):
    run, other = _offload_train(assets), _offload_rollout(assets)
    # offloaded before each rollout, reloaded before each update: equal to a run whose trainer stays resident
    _same_training(run, other, range(STEPS))
    assert run["checksum"] == other["checksum"]  # the same final weights, read after the loop
    assert len(run["events"]) == 2
    for events in run["events"]:  # engines keep their memory: one weight push (step 1), nothing released
        assert events and all(e["event"] == "update_weights" for e in events)
        assert {e["weight_version"] for e in events} == {"2"}
    for step in range(STEPS):
        assert run["metrics"][step]["offload/train_bytes"] > 0


def test_offload_rollout_alone_with_sparse_weight_updates(assets):
    run = _offload_rollout(assets)
    _same_training(run, _offload_train(assets), range(STEPS))  # engines' release and resume change nothing
    assert all("offload/train_bytes" not in run["metrics"][step] for step in range(STEPS))  # trainer stays
    assert len(run["events"]) == 2
    for events in run["events"]:
        # a step without a push releases only the KV cache (the weights stay, nothing would refill them)
        assert _phases(events) == NO_PUSH_STEP + PUSH_STEP + NO_PUSH_STEP


def test_colocate_protocol_order_and_exactness(assets):
    reference = _offload_train(assets)
    run = _cached(assets, "colocate", "--colocate")
    _same_training(run, reference, range(STEPS))  # offload + reload of both sides leave everything bit-identical
    _same_training(run, _offload_rollout(assets), range(STEPS))
    assert run["checksum"] == reference["checksum"]  # the same final weights, read after the loop
    assert len(run["events"]) == 2
    for events in run["events"]:
        assert _phases(events) == NO_PUSH_STEP + PUSH_STEP + NO_PUSH_STEP
        updates = [e for e in events if e["event"] == "update_weights"]
        # weights were pushed while the KV cache was still released, once, as version 2 (after step 1)
        assert updates and all(e["memory_released"] == ["kv_cache"] for e in updates)
        assert {e["weight_version"] for e in updates} == {"2"}
        times = [e["time"] for e in events]
        assert times == sorted(times) and [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    for step in range(STEPS):
        m = run["metrics"][step]
        assert m["offload/train_bytes"] > 0 and m["perf/engine_release_time"] >= 0
        print(f"\nstep {step}: trainer rank 0 RSS before offload {m['offload/train_rss_before'] / 2**20:.1f} MiB, "
              f"after {m['offload/train_rss_after'] / 2**20:.1f} MiB ({m['offload/train_bytes'] / 2**20:.1f} MiB "
              "offloaded)")
        assert m["offload/train_rss_after"] < m["offload/train_rss_before"]


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
