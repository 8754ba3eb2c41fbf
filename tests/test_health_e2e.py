"""--use-health-check through the controller (the shared Ray, 2 Megatron ranks on CPU, an embedded engine), with
real faults injected by RELAX_TEST_TRAINER_FAULT (relax.health_faults):

* a trainer rank SIGKILLed during step 1's update: the run restarts the Megatron roles alone from the step-1
  checkpoint (the rollout manager, its engine and the data plane stay) and finishes; a `restarted` notification
  goes out; metrics.jsonl holds each step once, and the sample ids trained at each step of the surviving
  history (--save-debug-train-data) are each step's own, each exactly once; the steps after the restart give
  the rollouts, losses, grad norms and rewards, and the final checkpoint (weights, optimizer, RNG, data position),
  of a fresh run resumed (--load) from the same checkpoint;
* a trainer rank SIGSTOPped (hung) at step 0 with --max-global-restart 0: found by its missing heartbeats within
  --heartbeat-timeout, and the run exits with code 1 and one line naming the rank, the step, the hang and how
  often it failed;
* the rollout manager SIGSTOPped (hung) during step 0's generation, a call without a deadline of its own: found
  by its missing heartbeats within --heartbeat-timeout, named, and the run restarted from step 0 (no checkpoint)
  and finished (one step)."""

import json
import logging
import shutil

import pytest
import torch

from conftest import assert_ray_released, shared_ray, shared_tiny_model
from test_notify import LocalHook

from relax.config import parse_config
from relax.core.run import run_controller
from relax.health_faults import ENV
from relax.models.tasks import generate_task_dataset
from relax.observability.train_dump import load_train_data

pytestmark = pytest.mark.e2e  # whole runs: Ray, trainer ranks, engines (deselect with -m 'not e2e')
BATCH, N = 2, 2  # prompts per step, samples per prompt


def _config(tmp_path, steps, *extra, ranks=2, name="out"):
    """`ranks` trainer ranks: 2 where a rank of a group fails, 1 where the fault is elsewhere or the rank count
    does not matter (one process fewer to start). `name`: the run's output folder under tmp_path."""
    data = str(generate_task_dataset(tmp_path / "train.jsonl", 20, seed=0, task="add_mod10"))
    out = tmp_path / name
    return parse_config([
        "--hf-checkpoint", str(shared_tiny_model()), "--prompt-data", data, "--apply-chat-template",
        "--input-key", "input", "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", str(BATCH),
        "--n-samples-per-prompt", str(N), "--num-rollout", str(steps), "--rollout-max-response-len", "4",
        "--micro-batch-size", "2", "--lr", "1e-3", "--lr-decay-style", "constant",
        "--resource", json.dumps({"actor": [1, ranks], "rollout": [1, 1]}), "--num-data-storage-units", "1",
        "--distributed-backend", "gloo", "--use-health-check", "--heartbeat-interval", "0.5",
        "--output-dir", str(out), *extra])


def _figures(caplog) -> None:
    """Print the detection and restart times the run logged (pytest -s shows them)."""
    for record in caplog.records:
        text = record.getMessage()
        if "after the injected fault" in text or "every role is back" in text:
            print(text)


def _metrics(out) -> dict:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _rollout(path) -> list:
    rows = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    return [(r["prompt_tokens"], r["response_tokens"], r["reward"]) for r in rows]


def _assert_same(a, b, where: str) -> None:
    """Bit for bit, through dicts, lists and tensors (a checkpoint's model, optimizer and RNG states)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


def _same_checkpoint(a, b, ranks: int = 2) -> None:
    """The final checkpoints of two runs hold the same weights, optimizer, RNG and data position."""
    for rank in range(ranks):
        name = f"actor/rank{rank:05d}.pt"
        _assert_same(torch.load(a / name, weights_only=False), torch.load(b / name, weights_only=False), name)
    assert json.loads((a / "relax_state.json").read_text()) == json.loads((b / "relax_state.json").read_text())


def _resume_matches(tmp_path, monkeypatch, out, step: int, steps: int) -> None:
    """A fresh run with --load of a copy of the checkpoint the restart resumed from (nothing after it, as a run
    killed there leaves) gives, step for step, the rollouts and metrics of the restarted run: the restart restored
    weights, optimizer, RNG and data position as a resume does, and the engine that stayed up did not carry state
    across (sampling is seeded per sample, relax.rollout.generate). Compared as tests/test_ckpt_resume_e2e does."""
    monkeypatch.delenv(ENV)
    name = f"iter_{step:07d}"
    ckpt = tmp_path / "resume_ckpt"
    shutil.copytree(out / "ckpt" / name, ckpt / name)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(step))
    resumed = tmp_path / "resumed"
    config = _config(tmp_path, steps, "--load", str(ckpt), "--save", str(resumed / "ckpt"),
                     "--save-debug-rollout-data", str(resumed / "rollouts" / "{rollout_id}.jsonl"), name="resumed")
    assert run_controller(config) == 0
    assert_ray_released()
    a, b = _metrics(out), _metrics(resumed)
    assert sorted(b) == list(range(step, steps))
    for s in range(step, steps):
        assert _rollout(out / "rollouts" / f"{s}.jsonl") == _rollout(resumed / "rollouts" / f"{s}.jsonl"), s
        for key in ("train/loss", "train/grad_norm", "train/lr", "rollout/reward_mean", "rollout/response_len_mean"):
            assert a[s][key] == b[s][key], (s, key, a[s][key], b[s][key])
    last = f"iter_{steps:07d}"
    _same_checkpoint(out / "ckpt" / last, resumed / "ckpt" / last)


def test_killed_rank_restarts_from_checkpoint(tmp_path, monkeypatch, caplog):
    shared_ray()
    monkeypatch.setenv(ENV, "kill:rank=1:step=1:call=train")
    out = tmp_path / "out"
    hook = LocalHook()  # --notify-urls: the restart is announced
    config = _config(tmp_path, 3, "--save", str(out / "ckpt"), "--save-interval", "1", "--max-global-restart", "2",
                     "--save-debug-train-data", str(out / "train" / "{rollout_id}_{rank}.pt"),
                     "--save-debug-rollout-data", str(out / "rollouts" / "{rollout_id}.jsonl"),
                     "--notify-urls", hook.url())
    try:
        with caplog.at_level(logging.INFO, logger="relax"):
            assert run_controller(config) == 0
    finally:
        hook.close()
    assert_ray_released()
    titles = [m.get("title", "") for m in hook.messages()]
    assert len(titles) == 1 and titles[0].endswith(" restarted"), titles
    assert "trainer rank 1 failed" in hook.messages()[0]["message"]
    _figures(caplog)

    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert steps == [0, 1, 2]  # each step once: the failed step 1 is done again after the restart
    restarts = [json.loads(x) for x in (out / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1
    assert restarts[0]["who"] == "trainer rank 1" and restarts[0]["resume_step"] == 1
    # the smallest scope: the Megatron roles alone; the rollout manager, its engine and the data plane stayed up
    assert restarts[0]["scope"] == "megatron roles"
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("rollout: 1 engine(s) behind") for m in messages) == 1, messages
    assert sum(m.startswith("trainer: 2 rank(s)") for m in messages) == 2
    assert "step 1" in restarts[0]["failed"]
    # Sample ids in and out of training: the checkpoint restored the rollout position, so the redone step 1
    # trains the ids step 1 was given before the kill; over the surviving history each id is trained once.
    per_step = {}
    for step in range(3):
        ids = set()
        for rank in range(2):
            ids |= {int(s["index"]) for s in load_train_data(str(out / "train" / f"{step}_{rank}.pt"))["samples"]}
        per_step[step] = ids
    assert [sorted(per_step[s]) for s in range(3)] == [list(range(s * BATCH * N, (s + 1) * BATCH * N))
                                                        for s in range(3)]
    totals = json.loads((out / "sample_accounting.json").read_text())
    assert totals["steps"] == 3 and totals["totals"]["trained"] == 3 * BATCH * N
    _resume_matches(tmp_path, monkeypatch, out, restarts[0]["resume_step"], 3)


def test_hung_rank_past_max_global_restart(tmp_path, monkeypatch, caplog):
    # --max-global-restart 0: the hang is found and the run gives up at once (restarts are the other tests')
    shared_ray()
    monkeypatch.setenv(ENV, "hang:rank=0:step=0")
    config = _config(tmp_path, 1, "--heartbeat-timeout", "4", "--max-global-restart", "0", ranks=1)
    with caplog.at_level(logging.INFO, logger="relax"):
        assert run_controller(config) == 1
    assert_ray_released()
    _figures(caplog)
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run failed: ")]
    assert len(failed) == 1, failed
    line = failed[0]
    assert line.startswith("run failed: trainer rank 0 (")
    assert "step 0" in line and "stopped (hung)" in line and "--heartbeat-timeout 4" in line
    assert "gave up after 0 restarts (--max-global-restart 0): trainer rank 0 failed 1 time" in line


def test_hung_rollout_manager_restarts_the_run(tmp_path, monkeypatch, caplog):
    shared_ray()
    monkeypatch.setenv(ENV, "hang:role=rollout:step=0:call=generate")
    out = tmp_path / "out"
    config = _config(tmp_path, 1, "--heartbeat-timeout", "4", "--max-global-restart", "1", ranks=1)
    with caplog.at_level(logging.INFO, logger="relax"):
        assert run_controller(config) == 0
    assert_ray_released()
    _figures(caplog)
    assert "health: rollout failure detected" in caplog.text
    assert "no checkpoint under --save or --load: restarting from step 0" in caplog.text
    restarts = [json.loads(x) for x in (out / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["who"] == "rollout" and restarts[0]["resume_step"] == 0
    assert restarts[0]["scope"] == "every role"  # not a Megatron role: the next rung
    failed = restarts[0]["failed"]
    assert failed.startswith("rollout (") and "step 0, generate: WorkerSilent: no heartbeat" in failed
    assert "--heartbeat-timeout 4" in failed and "stopped (hung)" in failed
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [0]
