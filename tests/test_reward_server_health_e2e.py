"""The reward server's watch in a whole run (the shared Ray, 1 trainer rank, the embedded engine, --rm-type remote_rm
at a reward server process the test starts, --use-fault-tolerance), with two faults of the test-only injection
(relax.health_faults, role=reward) armed on the rollout manager; one run, as a start-up costs more than
both faults:

* SIGSTOP at step 1's first reward request, SIGCONT 4 s later: found within the probe's interval and timeout,
  named in <output-dir>/reward_server.jsonl, the held requests sent again; steps 0 and 1 train every sample id
  exactly once and no failed reward (0.0, `reward_error`);
* SIGKILL at step 2, never back: the run ends with exit code 1 and one line naming the server, `dead` and
  --reward-timeout, within that bound, and --use-health-check does not restart it (no restart can bring the
  server back).

`pytest -s` prints the measured detection and recovery times."""

import json
import logging
import signal
import time

import pytest
import ray

import reward_server_proc
from conftest import assert_ray_released, shared_ray, shared_tiny_model

from relax.config import parse_config
from relax.core.controller import Controller
from relax.health_faults import RankFault
from relax.core.run import run_controller
from relax.models.tasks import generate_task_dataset
from relax.observability.accounting import step_problems
from relax.observability.train_dump import load_train_data
from relax.rollout.debug_data import load_rollout_data

pytestmark = pytest.mark.e2e  # whole runs: Ray, a trainer rank, an engine (deselect with -m 'not e2e')
BATCH, N = 2, 2  # prompts per step, samples per prompt
INTERVAL, PROBE_TIMEOUT = 0.5, 2.0
BOUND = 5  # --reward-timeout: longer than the hang's wait (4 s less its detection), the kill's wait


@pytest.fixture
def server(tmp_path):
    proc, url, hits = reward_server_proc.start(tmp_path)
    yield proc, url, hits
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.wait(10)


def _config(tmp_path, url, steps, *extra):
    data = str(generate_task_dataset(tmp_path / "train.jsonl", 20, seed=0, task="add_mod10"))
    out = tmp_path / "out"
    return parse_config([
        "--hf-checkpoint", str(shared_tiny_model()), "--prompt-data", data, "--apply-chat-template",
        "--input-key", "input", "--label-key", "label", "--rm-type", "remote_rm", "--rm-url", url,
        "--reward-error-policy", "zero",  # without the watch a failed reward would be trained on as 0.0
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N), "--num-rollout", str(steps),
        "--rollout-max-response-len", "4", "--micro-batch-size", "2", "--lr", "1e-3", "--lr-decay-style", "constant",
        "--resource", json.dumps({"actor": [1, 1], "rollout": [1, 1]}), "--num-data-storage-units", "1",
        "--distributed-backend", "gloo", "--use-fault-tolerance",
        "--rollout-health-check-interval", str(INTERVAL), "--rollout-health-check-timeout", str(PROBE_TIMEOUT),
        "--output-dir", str(out), *extra])


def _arm(*specs):
    """Arm `specs` on the rollout manager's reward server watch once the run's roles are up (the shared Ray's
    workers do not see the test's RELAX_TEST_TRAINER_FAULT, which `relax-train` runs read)."""

    def arm(manager, texts):
        manager.rewards.server_watch.faults = [RankFault.parse(t) for t in texts]

    start = Controller.start

    def start_and_arm(self):
        start(self)
        ray.get(self.rollout.__ray_call__.remote(arm, list(specs)))

    return start_and_arm


def test_hung_then_killed_reward_server(tmp_path, server, monkeypatch, caplog):
    proc, url, hits = server
    shared_ray()
    out = tmp_path / "out"
    config = _config(tmp_path, url, 3, "--reward-timeout", str(BOUND),
                     # a lost reward server ends the run at once: no restart can bring it back
                     "--use-health-check", "--max-global-restart", "1",
                     "--save-debug-rollout-data", str(out / "rollout" / "{rollout_id}.jsonl"),
                     "--save-debug-train-data", str(out / "train" / "{rollout_id}.pt"))
    monkeypatch.setattr(Controller, "start", _arm("hang:role=reward:step=1:resume=4", "kill:role=reward:step=2"))
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="relax"):
        assert run_controller(config) == 1
    elapsed = time.monotonic() - t0
    assert_ray_released()

    events = [json.loads(x) for x in (out / "reward_server.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["fault_injected", "down", "up", "fault_injected", "down", "lost"], events
    hung, down, up, killed, dead, lost = events
    # the hang: named within one probe interval and timeout, answering again at the SIGCONT
    detect_s, back_s = down["time"] - hung["time"], up["time"] - hung["time"]
    assert hung["step"] == 1 and hung["fault"] == "hang" and "hung: " in down["why"]
    assert detect_s <= INTERVAL + PROBE_TIMEOUT + 1.0, detect_s  # (+ a loaded machine's slack)
    assert 4.0 <= back_s <= 4.0 + INTERVAL + 2.0, back_s
    assert up["held"] >= 1  # the step's requests sent before it was found were sent again
    # the kill: named, and the run stopped --reward-timeout later
    kill_detect_s, stop_s = dead["time"] - killed["time"], lost["time"] - killed["time"]
    assert killed["step"] == 2 and killed["fault"] == "kill" and dead["why"].startswith("dead: ")
    assert kill_detect_s <= INTERVAL + 1.0 and BOUND <= stop_s <= BOUND + INTERVAL + 2.0, (kill_detect_s, stop_s)
    print(f"reward server hung: named {detect_s:.2f} s after SIGSTOP, answering again {back_s:.2f} s after it "
          f"(SIGCONT at 4 s), {up['held']} request(s) held and sent again; killed: named {kill_detect_s:.2f} s "
          f"after SIGKILL, the run stopped {stop_s:.2f} s after it (--reward-timeout {BOUND}); run {elapsed:.1f} s")

    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run failed: ")]
    assert len(failed) == 1 and "\n" not in failed[0], failed
    line = failed[0]
    assert f"step 2, generate: RewardServerLost: reward server {url} does not answer /health for " in line
    assert "(dead: connection" in line and f"(--reward-timeout {BOUND})" in line
    assert proc.wait(5) == -signal.SIGKILL
    assert not (out / "restarts.jsonl").exists()
    assert "health: not restarting: the reward server is not a role of this run" in caplog.text

    # steps 0 and 1 (the hang): every sample id trained once, every reward the server's
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for step, rec in enumerate(records):
        assert step_problems(rec, trained_expected=True) == []
        assert rec["samples/reward_failed"] == 0 and rec["train/reward_failed_samples"] == 0
        samples = load_rollout_data(config.save_debug_rollout_data, step)
        assert all("reward_error" not in s.metadata for s in samples)
        assert {s.reward for s in samples} <= {reward_server_proc.OK, reward_server_proc.OTHER}  # never 0.0
        trained = [int(r["index"]) for r in load_train_data(str(out / "train" / f"{step}.pt"))["samples"]]
        assert sorted(trained) == list(range(step * BATCH * N, (step + 1) * BATCH * N))  # each id once
    assert len(hits.read_text().splitlines()) >= 2 * BATCH * N  # answered by the server (held ones possibly twice)
