"""--use-fault-tolerance through the controller (Ray, Megatron on CPU, 2 embedded engines behind sglang-router):
an engine killed (SIGKILL) or hung (SIGSTOP) while it holds requests, by the test-only fault injection of the
rollout manager (relax.rollout.fault_injection). The run finishes; the failed engine's requests were sent
again to the other engine, every sample of every step is there exactly once (the saved rollout data and the
run's sample accounting); the replacement joins at the current weight version, the weight push reaches the
pool's engines of the moment, and an engine added after the run's last push serves that push's weights. A killed
router is started again at its address with both engines, and the step loses no sample."""

import json
import time

import pytest
import ray

from conftest import assert_ray_released, shared_ray, shared_tiny_model

from relax.wire.engine_client import EngineClient
from relax.config import parse_config
from relax.core.controller import Controller
from relax.models.tasks import generate_task_dataset
from relax.observability.accounting import step_problems
from relax.rollout.debug_data import load_rollout_data

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')

BATCH, N = 4, 2
INTERVAL, TIMEOUT = 0.5, 3.0


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("fault")
    data = generate_task_dataset(base / "train.jsonl", 16, seed=0, task="add_mod10")
    return base, str(shared_tiny_model()), str(data)


def make_config(assets, out, steps, *extra):
    """The runs' flags (2 engines, fault tolerance with fast probes), then `extra` (later flags win)."""
    base, model, data = assets
    return parse_config([
        "--hf-checkpoint", model, "--prompt-data", data, "--apply-chat-template", "--input-key", "input",
        "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", str(BATCH),
        "--n-samples-per-prompt", str(N), "--num-rollout", str(steps), "--rollout-max-response-len", "96",
        "--rollout-temperature", "1.0", "--micro-batch-size", "8", "--lr", "1e-3", "--lr-decay-style", "constant",
        "--resource", '{"actor": [1, 1], "rollout": [1, 2]}', "--distributed-backend", "gloo",
        "--use-fault-tolerance", "--rollout-health-check-interval", str(INTERVAL),
        "--rollout-health-check-timeout", str(TIMEOUT),
        "--save-debug-rollout-data", str(base / out / "rollout_{rollout_id}.jsonl"),
        "--output-dir", str(base / out), *extra])


def wait_active(rollout, count, timeout_s=180.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engines = ray.get(rollout.list_engines.remote())
        if sum(e["state"] == "active" for e in engines) == count:
            return engines
        time.sleep(0.5)
    raise AssertionError(f"not {count} active engines within {timeout_s} s: {engines}")


def check_samples(config, records):
    """Every step trained exactly its prompt groups' samples, each sample once, all at one weight version."""
    for step, rec in enumerate(records):
        assert step_problems(rec, trained_expected=True) == []
        assert rec["samples/to_train"] == rec["samples/trained"] == BATCH * N
        samples = load_rollout_data(config.save_debug_rollout_data, step)
        assert len({s.index for s in samples}) == len(samples) == BATCH * N
        groups = {}
        for s in samples:
            groups.setdefault(s.group_index, []).append(s)
        assert len(groups) == BATCH and all(len(g) == N for g in groups.values())
        assert {s.weight_version for s in samples} == {step}, step  # step 0: --hf-checkpoint, reported as 0


def run_with_faults(config, faults, add_engine=True):
    """Run `config` with `faults` armed; returns (metrics records, pool events, each engine's weight version at
    the end). Every engine of the end (the replacements, and one added after the run when `add_engine`) gives
    the same greedy log-probs: they serve the same weights."""
    shared_ray()
    controller = Controller(config)
    try:
        controller.start()
        for fault in faults:
            ray.get(controller.rollout.inject_engine_fault.remote(fault))
        controller.run()
        urls = [e["url"] for e in wait_active(controller.rollout, 2)]
        events = ray.get(controller.rollout.engine_events.remote())
        if add_engine:  # an engine added now gets the last push's weights before it serves
            urls += ray.get(controller.rollout.add_engines.remote(1))
        versions = {u: EngineClient(u, timeout_s=30).get_weight_version() for u in urls}
        payload = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
                   "return_logprob": True}
        answers = [EngineClient(u, timeout_s=60)._post("/generate", payload)["meta_info"]["output_token_logprobs"]
                   for u in urls]
        assert all(a == answers[0] for a in answers), dict(zip(urls, answers))
    finally:
        controller.shutdown()
    assert_ray_released()
    records = [json.loads(line) for line in open(f"{config.output_dir}/metrics.jsonl")]
    return records, events, versions


def injected(events, target):
    return next(e for e in events if e["kind"] == "fault_injected" and e.get("target", "engine") == target)


def check_killed_engine_replaced(events, records, step):
    """The engine killed at `step` died holding requests; it was found failed (in the metrics of `step`, or of the
    step after it when sglang-router's own retry finished the step's requests before the next probe round found
    the engine dead) and replaced; the replacement joined serving the version of the last push before it joined,
    and that push's weights were sent to it (the kept copy of trainer rank 0, or the push itself). Returns the
    (fault_injected, engine_failed, engine_replaced) events and the record that counted the failure."""
    counted = [r for r in records[step:] if r["engines/failed"]]
    assert [r["engines/failed"] for r in counted] == [1] and counted[0]["step"] in (step, step + 1), records
    assert all(r["engines/failed"] == 0 for r in records[:step]), records
    engine_kill = injected(events, "engine")
    failed = next(e for e in events if e["kind"] == "engine_failed")
    replaced = next(e for e in events if e["kind"] == "engine_replaced")
    assert engine_kill["in_flight"] and failed["url"] == engine_kill["url"] and replaced["old_url"] == failed["url"]
    pushes = [e for e in events if e["kind"] == "weights_pushed" and e["time"] < replaced["time"]]
    assert replaced["weight_version"] == pushes[-1]["weight_version"] in {str(step + k) for k in range(3)}, events
    synced = [e for e in events if e["kind"] == "engine_synced" and e["url"] == replaced["url"]]
    assert synced and synced[-1]["pushed"]
    return engine_kill, failed, replaced, counted[0]


# Each run tests two recoveries one after the other (a whole run costs ~45 s of start-up and shutdown on 2 cores):
# the router first, so that both engines are up when it is started again. Its fault is armed at step 0: on a
# loaded host the kill may land just after the step's last request went through it (a step sends one request per
# engine), and then step 1's requests need it; a whole step lies between it and the engine's fault of step 2.
def test_killed_router_then_killed_engine_lose_no_sample(assets):
    config = make_config(assets, "kill", steps=4)  # a step after the engine's fault, where it may be counted
    records, events, versions = run_with_faults(config, ["kill:router:step=0", "kill:engine=1:step=2"])
    assert len(records) == 4
    check_samples(config, records)  # the requests sent while each was down were sent again: every sample once
    # the router: started again at its address with both engines, the step losing no sample
    router_kill = injected(events, "router")
    restarted = next(e for e in events if e["kind"] == "router_restarted")
    assert router_kill["in_flight"] and restarted["url"] == router_kill["url"] and restarted["engines"] == 2, events
    assert [r["engines/router_restarts"] for r in records[:2]] in ([1, 0], [0, 1]), records[:2]
    assert all(r["engines/failed"] == 0 for r in records[:2]), records[:2]
    assert restarted["time"] - router_kill["time"] < INTERVAL + 30.0  # found at the next round, plus its start
    # the engine: it died holding requests; they were sent again (by sglang-router's own retry to another
    # worker, or by the rollout's failover resends), since every sample of the step is there once
    engine_kill, failed, replaced, fault = check_killed_engine_replaced(events, records, step=2)
    assert set(versions.values()) == {"4"}  # the last push reached the replacement; the added engine got it too
    print(f"router: restarted {restarted['time'] - router_kill['time']:.2f} s after the kill; engine: resends "
          f"{fault['rollout/failover_resends']:g}, detected after {failed['time'] - engine_kill['time']:.2f} s, "
          f"replaced {replaced['time'] - failed['time']:.2f} s later")


def test_hung_router_then_hung_engine_are_replaced(assets):
    # the router's fault may hit after step 0's last request went through it: step 1's requests need it
    config = make_config(assets, "hang", steps=3)
    records, events, versions = run_with_faults(config, ["hang:router:step=0", "hang:engine=0:step=2"])
    assert len(records) == 3
    check_samples(config, records)
    router_hang = injected(events, "router")
    restarted = next(e for e in events if e["kind"] == "router_restarted")
    assert "/health" in restarted["reason"] and restarted["engines"] == 2
    # two silent rounds (each a probe interval plus its timeout), then the stop and the start
    assert restarted["time"] - router_hang["time"] < 2 * (INTERVAL + TIMEOUT) + 30.0
    engine_hang = injected(events, "engine")
    failed = next(e for e in events if e["kind"] == "engine_failed")
    replaced = next(e for e in events if e["kind"] == "engine_replaced")
    assert failed["url"] == engine_hang["url"] and "health_generate" in failed["reason"]
    assert engine_hang["in_flight"] and records[2]["engines/failed"] == 1, records[2]
    # one probe interval (the probe may have just started) plus one probe timeout, plus slack on a loaded CPU
    assert failed["time"] - engine_hang["time"] < INTERVAL + TIMEOUT + 2.0
    assert set(versions.values()) == {"3"}
    print(f"hang: resends {records[2]['rollout/failover_resends']:g}, detected after "
          f"{failed['time'] - engine_hang['time']:.2f} s, replaced {replaced['time'] - failed['time']:.2f} s later")


def test_fault_spec_parses_engine_and_router_targets():
    from relax.rollout.fault_injection import EngineFault

    assert EngineFault.parse("kill:engine=1:step=2") == EngineFault("kill", 1, 2)
    assert EngineFault.parse("hang:router:step=0:wait=5") == EngineFault("hang", 0, 0, 5.0, router=True)
    for bad in ("kill:step=1", "kill:engine=1", "kill:rooter:step=1", "stop:router:step=1"):
        with pytest.raises(ValueError):
            EngineFault.parse(bad)
