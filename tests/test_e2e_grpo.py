"""End to end on CPU: real Ray, Megatron-core over gloo (2 data-parallel ranks), 2 embedded engines behind
sglang-router, TransferQueue, weight sync and a checkpoint — through the controller, as relax-train runs it."""

import json

import psutil
import pytest
import ray

from conftest import assert_ray_released, shared_ray
from test_timeline import assert_lanes_do_not_overlap, check_chrome_trace

from relax.config import parse_config
from relax.config.env import TIMELINE_ENV
from relax.core.controller import Controller

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')


def _children():
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_grpo_two_engines_two_dp_ranks(assets, monkeypatch):
    base, model, data = assets
    out = base / "run"
    shared_ray()
    monkeypatch.setenv(TIMELINE_ENV, str(out / "timeline"))  # what run_controller sets for --timeline-dump-dir
    before = _children()
    config = parse_config([
        "--hf-checkpoint", model, "--prompt-data", data, "--apply-chat-template", "--input-key", "input",
        "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--num-rollout", "2", "--rollout-max-response-len", "3",
        "--micro-batch-size", "4", "--lr", "1e-3", "--lr-decay-style", "constant",
        "--resource", '{"actor": [1, 2], "rollout": [1, 2]}', "--num-data-storage-units", "2",
        "--save-interval", "2", "--output-dir", str(out), "--distributed-backend", "gloo",
        "--use-tensorboard", "--timeline-dump-dir", str(out / "timeline"),
    ])
    controller = Controller(config)
    try:
        controller.start()
        assert len(controller.engine_urls) == 2
        before_sum = ray.get(controller.workers[0].weights_checksum.remote())
        controller.run()
        after_sum = ray.get(controller.workers[0].weights_checksum.remote())
        assert after_sum != before_sum, "the optimizer did not change the weights"
        from relax.wire.engine_client import EngineClient

        for url in controller.engine_urls:
            client = EngineClient(url, timeout_s=60)
            assert str(client.get_weight_version()) == "2"
            # The engine serves the trainer's weights: its log-probs of a sequence equal the trainer's.
            prompt = [257, 84, 82, 68, 81, 198, 18, 10, 19, 28, 258, 198, 257, 64]
            reply = client.generate(prompt, {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True},
                                    return_logprob=True)
            pairs = reply["meta_info"]["output_token_logprobs"]
            ids, engine_lp = [p[1] for p in pairs], [p[0] for p in pairs]
            trainer_lp = ray.get([w.compute_logprobs.remote([prompt + ids], [len(ids)], 1.0)
                                  for w in controller.workers])[0][0]
            assert len(trainer_lp) == len(engine_lp) == 8
            assert max(abs(a - b) for a, b in zip(trainer_lp, engine_lp)) < 1e-4, (trainer_lp, engine_lp)
        assert controller.data.stats()["num_partitions"] == 0  # partitions are cleared once consumed
    finally:
        controller.shutdown()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["rollout/num_samples"] == 16.0 and r["data/step_samples"] == 16.0
        # sample accounting: every generated sample was kept, sent to training and trained
        assert r["samples/generated"] == r["samples/kept"] == r["samples/to_train"] == r["samples/trained"] == 16.0
        assert r["train/loss"] == r["train/loss"] and abs(r["train/loss"]) < 1e3
        assert r["train/grad_norm"] > 0
        for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/clip_fraction", "train/entropy",
                    "perf/step_time", "perf/rollout_time", "perf/train_time", "perf/weight_sync_time",
                    "perf/tokens_per_s"):
            assert key in r, key
    totals = json.loads((out / "sample_accounting.json").read_text())["totals"]
    assert totals["generated"] == totals["trained"] == 32 and totals["dropped"] == 0
    ckpt = out / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (ckpt / "iter_0000002" / "relax_state.json").is_file()
    assert any((ckpt / "iter_0000002" / "actor").iterdir())
    assert any((out / "tensorboard").rglob("events.out.tfevents*"))
    _check_timeline(out / "timeline" / "timeline.json", records)
    assert_ray_released()
    # engine servers and the router are gone; Ray's own worker processes stay with the session's cluster
    leftover = [p for p in _children() - before if _alive_non_ray(p)]
    assert not leftover, f"processes left behind: {[psutil.Process(p).cmdline()[:3] for p in leftover]}"


def _check_timeline(path, records) -> None:
    """--timeline-dump-dir: a Chrome trace whose step spans hold every stage of the step, the stages covering
    the step's wall time but for the controller's own bookkeeping."""
    doc = json.loads(path.read_text())
    spans = check_chrome_trace(doc)
    tracks = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    roles = {name.split(" (")[0] for name in tracks.values()}
    # the roles' own tracks: both trainer ranks, the rollout manager, both engines
    assert {"controller", "trainer rank 0", "trainer rank 1", "rollout manager"} <= roles, roles
    assert sum(name.startswith("engine ") for name in roles) == 2, roles
    for r in records:
        step = r["step"]
        (outer,) = [s for s in spans if s["name"] == f"step {step}"]
        inner = [s for s in spans if s["args"].get("step") == step and s is not outer and s["pid"] == outer["pid"]]
        updates = [s for s in spans if s["name"] == "actor update" and s["args"].get("step") == step]
        assert len(updates) == 2 and all(outer["ts"] <= s["ts"] <= outer["ts"] + outer["dur"] for s in updates)
        names = {s["name"] for s in inner}
        assert {"rollout", "actor_forward", "advantages", "actor_update", "weight_push"} <= names, names
        for s in inner:
            assert outer["ts"] <= s["ts"] and s["ts"] + s["dur"] <= outer["ts"] + outer["dur"] + 1, s["name"]
        covered = sum(s["dur"] for s in inner)
        assert 0.8 * outer["dur"] <= covered <= outer["dur"] + 1, (covered, outer["dur"])
        assert abs(outer["dur"] / 1e6 - r["perf/step_time"]) < 0.5
        # reward calls: one span per prompt group, on the rollout manager's track, inside the step
        scored = [s for s in spans if s["cat"] == "reward" and s["args"].get("step") == step]
        assert len(scored) == 4 and sum(s["args"]["samples"] for s in scored) == r["rollout/num_samples"], scored
        assert {tracks[s["pid"]].split(" (")[0] for s in scored} == {"rollout manager"}
        assert all(outer["ts"] <= s["ts"] and s["ts"] + s["dur"] <= outer["ts"] + outer["dur"] + 1 for s in scored)
    assert_lanes_do_not_overlap([s for s in spans if s["cat"] == "reward"])


def _alive_non_ray(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and not (proc.cmdline() or ["ray::"])[0].startswith("ray::")
    except psutil.NoSuchProcess:
        return False
