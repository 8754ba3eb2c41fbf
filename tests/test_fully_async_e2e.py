"""--fully-async end to end on CPU (relax.core.async_loop), on the tests' tiny model:

* --max-staleness 0 is the synchronous schedule: the same learning metrics, exactly, as the sync loop
  (its records kept in tests/data);
* --max-staleness 1: every sample index is trained exactly once, staleness never exceeds 1, and the rollout
  of step N+1 runs while step N trains (wall-clock stamps); the same run's checkpoint resumes (below);
* --num-iters-per-train-update 2 (streaming chunks): the unchunked step's loss and grad_norm, each index trained
  once, training of the first chunk started before the step's rollout ended;
* a rollout that fails while a step trains stops the loop with the stage named and gives every resource back;
* SIGINT while the rollout hangs beside training stops the run promptly and leaves no process;
* a checkpoint of an async run resumes with the rollout position of the saved step: the resumed run trains
  the indexes the first run had generated but not trained, none twice.
"""

import json
import signal
import time

import pytest
import recorded_runs
from conftest import assert_ray_released, run_steps, shared_tiny_model
from run_helpers import assert_nothing_left, run_processes, start_run, wait_for_file, write_hooks

from relax.wire.core_share import node_cores
from relax.formats.checkpoint_layout import iter_dir, read_run_state, write_marker
from relax.config import parse_config
from relax.core.deadlines import RoleFailure
from relax.rollout.sglang_rollout import generate_rollout
from relax.models.tasks import generate_task_dataset

pytestmark = pytest.mark.e2e  # whole runs: Ray, trainer, engines
SYNC_RECORD = "fully_async_tiny_sync_seed5"  # the sync loop's learning metrics of `_config(..., "--num-rollout", "3")`


def _config(tmp_path, name, *extra):
    data = tmp_path / "train.jsonl"
    if not data.exists():
        generate_task_dataset(data, 40, seed=0, task="add_mod10")
    return parse_config([
        "--hf-checkpoint", str(shared_tiny_model()), "--prompt-data", str(data), "--apply-chat-template",
        "--input-key", "input", "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-2", "--resource", '{"actor": [1, 1], "rollout": [1, 1]}',
        "--num-data-storage-units", "1", "--output-dir", str(tmp_path / name), "--distributed-backend", "gloo",
        "--seed", "5", *extra])


def _learning(record):
    return {k: v for k, v in record.items() if not k.startswith(("perf/", "async/"))}


def test_staleness_zero_is_the_sync_run(tmp_path):
    """Compared with the synchronous loop's records of the same config, kept in tests/data (recorded with
    RELAX_RECORD_STAGES=1, like tests/test_stages_exact.py, which checks that the sync loop still gives its own
    records): one whole run fewer in the suite. A deliberate change of the sync numerics re-records both."""
    if recorded_runs.RECORD:
        sync = run_steps(_config(tmp_path, "sync", "--num-rollout", "3"))
        recorded_runs.record(SYNC_RECORD, [_learning(r) for r in sync])
        return
    fully = run_steps(_config(tmp_path, "async", "--num-rollout", "3", "--fully-async", "--max-staleness", "0"))
    assert len(fully) == 3
    for sync in recorded_runs.variants(SYNC_RECORD):  # one per CPU kernel family (tests/recorded_runs.py)
        assert sync[0]["train/grad_norm"] > 0
        assert {"rollout/reward_mean", "train/loss", "train/grad_norm", "samples/trained"} <= set(sync[0]), sync[0]
    # a metric added since the recording is not compared; one gone or changed fails (re-record if the sync loop
    # changed on purpose)
    recorded_runs.check(SYNC_RECORD, [_learning(b) for b in fully])
    for step, b in enumerate(fully):
        assert b["async/staleness_max"] == 0 and b["async/queue_depth"] == 0
        assert "perf/trainer_threads_mean" not in b  # the trainer's thread count is fixed (relax.wire.core_share)
        if step:  # strict alternation: step N's rollout starts after step N-1's push
            assert b["async/rollout_start"] >= fully[step - 1]["async/train_end"]


def _check_indexes(records, first_index=0):
    expected = first_index
    for r in records:  # consecutive steps tile the indexes: each trained once, none skipped
        assert r["async/index_min"] == expected, r
        assert r["async/index_max"] - r["async/index_min"] + 1 == r["async/num_indexes"] == r["data/step_samples"]
        expected = int(r["async/index_max"]) + 1
    return expected


def test_staleness_one_overlaps_trains_each_sample_once_and_resumes(tmp_path, monkeypatch):
    """--max-staleness 1: each sample index trained once, staleness within 1 and the rollouts overlapping
    training. Its checkpoint after step 1 was saved while step 2 was generated (or generating): it holds the rollout
    position after step 1, so a run resumed from it generates step 2 again from the same prompts, with the indexes
    the interrupted run never trained."""
    save = tmp_path / "ckpt"
    # the trainer takes the cores the rollout leaves idle (relax.wire.core_share) also at the tiny model's width
    monkeypatch.setenv("RELAX_SHARE_IDLE_CORES", "1")
    records = run_steps(_config(tmp_path, "s1", "--num-rollout", "4", "--fully-async", "--max-staleness", "1",
                                "--save", str(save), "--save-interval", "2"))
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert _check_indexes(records) == 4 * 8
    assert all(r["samples/trained"] == 8 for r in records)
    assert all(0 <= r["async/staleness_max"] <= 1 and r["async/queue_depth"] <= 1 for r in records)
    assert max(r["async/staleness_max"] for r in records) == 1  # the rollout really ran a policy behind
    overlaps = [records[n + 1]["async/rollout_start"] < records[n]["async/train_end"] for n in range(3)]
    assert any(overlaps), overlaps
    # the trainer took the cores the rollout left idle, within its own share and the node's cores
    assert all(1 <= r["perf/trainer_threads_mean"] <= node_cores() for r in records), records

    assert read_run_state(iter_dir(save, 2))["next_index"] == 2 * 8  # not step 2's rollout, which had started
    write_marker(save, 2)  # as if the run had stopped after that checkpoint
    resumed = run_steps(_config(tmp_path, "b", "--num-rollout", "4", "--fully-async", "--max-staleness", "1",
                                "--load", str(save)))
    assert [r["step"] for r in resumed] == [2, 3]
    assert _check_indexes(resumed, first_index=2 * 8) == 4 * 8
    # the same prompts as the interrupted run's steps 2 and 3 (rewards are random: compare the prompt groups)
    assert [r["rollout/num_groups"] for r in resumed] == [r["rollout/num_groups"] for r in records[2:]]


def test_streaming_chunks_give_the_unchunked_update(tmp_path):
    """--num-iters-per-train-update 2 (relax.core.streaming): each step arrives in 2 chunks of whole prompt
    groups and the trainer starts on the first while the rollout generates the second. Step 0 (same seed, same
    weights, same samples) gives the unchunked step's loss and grad_norm to float32 round-off; every sample
    index is trained once; training began before the step's rollout ended. With the KL loss: the reference
    role computes each chunk's log-probs before the trainer takes it, and the KL term is the unchunked one."""
    base = ("--num-rollout", "2", "--fully-async", "--max-staleness", "0", "--rollout-batch-size", "4",
            "--global-batch-size", "16", "--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl")
    whole = run_steps(_config(tmp_path, "k1", *base))
    chunked = run_steps(_config(tmp_path, "k2", *base, "--num-iters-per-train-update", "2"))
    assert [r["step"] for r in chunked] == [0, 1]
    assert whole[0]["rollout/reward_mean"] == chunked[0]["rollout/reward_mean"]  # the same samples
    for key in ("rollout/generated_groups", "samples/generated", "rollout/returned_groups"):  # and no more
        assert [r[key] for r in chunked] == [r[key] for r in whole], key
    # group-relative advantages at ratio 1 make the loss ~0 (round-off): compared absolutely
    assert chunked[0]["train/loss"] == pytest.approx(whole[0]["train/loss"], rel=1e-5, abs=1e-7)
    assert chunked[0]["train/grad_norm"] == pytest.approx(whole[0]["train/grad_norm"], rel=1e-5)
    assert whole[0]["train/grad_norm"] > 0
    # step 1 trains a policy moved by step 0's update away from the reference: a KL term that is not 0
    assert whole[1]["train/kl"] > 0 and chunked[1]["train/kl"] == pytest.approx(whole[1]["train/kl"], rel=1e-5)
    assert chunked[1]["train/loss"] == pytest.approx(whole[1]["train/loss"], rel=1e-5, abs=1e-7)
    assert all(r["perf/ref_logprob_time"] > 0 for r in chunked)
    assert _check_indexes(chunked) == 2 * 16
    assert all(r["samples/trained"] == 16 and r["async/num_chunks"] == 2 and r["train/num_chunks"] == 2
               for r in chunked)
    assert all(r["async/first_chunk_train_start"] < r["async/rollout_end"] for r in chunked), \
        [(r["async/first_chunk_train_start"], r["async/rollout_end"]) for r in chunked]
    assert all(r["async/first_chunk_lead_time"] > 0 for r in chunked)


def rollout_failing_at_step_2(ctx, step):
    """--rollout-function-path of the failure test: step 2's rollout (running beside step 1's training) fails."""
    if step == 2:
        raise RuntimeError("rollout broke at step 2")
    return generate_rollout(ctx, step)


def test_rollout_failure_stops_the_loop_with_the_stage_named(tmp_path):
    config = _config(tmp_path, "fail", "--num-rollout", "4", "--fully-async", "--max-staleness", "1",
                     "--rollout-function-path", "test_fully_async_e2e.rollout_failing_at_step_2")
    with pytest.raises(RoleFailure, match="rollout, step 2, generate: RuntimeError: rollout broke at step 2") as info:
        run_steps(config)
    assert_ray_released()
    records = [line for line in (tmp_path / "fail" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) <= 2, info.value  # steps 0 and 1 at most: nothing trained after the failure


def test_sigint_while_the_rollout_hangs_beside_training_stops_promptly(tmp_path):
    """SIGINT while step 1's rollout (running beside training) is stuck in a reward call that never returns:
    exit 130 within seconds, step 0 trained and logged, nothing of the run left behind."""
    env, marks = write_hooks(tmp_path)
    out = tmp_path / "run"
    proc = start_run(out, "--num-rollout", "50", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                     "--num-steps-per-rollout", "1", "--custom-rm-path", "relax_test_hooks.never_from_step_one",
                     "--fully-async", "--max-staleness", "1", env=env, ignore_sigint=True)
    metrics = out / "metrics.jsonl"
    try:
        wait_for_file(marks / "reward_called", proc)
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and '"step": 0' in metrics.read_text()):  # step 0 trained beside it
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.2)
        processes = run_processes(proc)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=180)
        stopped_after = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130 and stopped_after < 30, (code, stopped_after)
    assert "interrupted by SIGINT; shutting down" in (out / "logs" / "relax.log").read_text()
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines() if '"step"' in x] == [0]
    assert_nothing_left(processes)
