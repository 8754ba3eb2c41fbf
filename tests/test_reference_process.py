"""relax.roles.reference_process: the one-rank actor's reference model in a child process gives the rows the same
model gives in the rank's own process, bitwise, and every way the child can fail reaches the caller as an error
naming what was asked (never a hang, never rows of another request)."""

import os
import shutil
import signal

import pytest
import torch

from relax.backends.megatron.testing import ensure_single_process
from relax.config import parse_config
from relax.roles.megatron_settings import build_reference_trainer
from relax.roles.reference_process import POLICY, REFERENCE, ReferenceProcess, ReferenceProcessError
from relax.config.facts import streams_old_logprobs
from relax.roles.step_passes import StepPasses, parts_for


def _config(tmp_path, model, *extra):
    return parse_config(["--hf-checkpoint", model, "--output-dir", str(tmp_path), "--use-kl-loss", *extra])


def _inputs(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt, response = 5 + i % 4, 1 + i % 3
        out.append({"tokens": torch.randint(0, 200, (prompt + response,), generator=g), "response_length": response})
    return out


def test_rows_are_the_in_process_rows(tmp_path, tiny_model):
    config = _config(tmp_path, tiny_model, "--micro-batch-size", "4")
    child = ReferenceProcess(config, threads=1)
    try:
        ensure_single_process()
        torch.set_num_threads(1)
        here = build_reference_trainer(config)[0]
        inputs = _inputs(11)
        expected = here.compute_logprobs(inputs, 0.7)
        child.start([x["tokens"].tolist() for x in inputs], [x["response_length"] for x in inputs], 0.7)
        rows, start, end = child.result()
        assert start <= end
        assert len(rows) == len(expected)
        for got, want in zip(rows, expected):
            assert got.dtype == torch.float32 and torch.equal(got, want)
        # the rank's other calls: a synchronous pass and the weights' checksum
        assert all(torch.equal(a, b) for a, b in zip(child.compute_logprobs(inputs[:3], 0.7), expected[:3]))
        with torch.no_grad():
            checksum = float(sum(p.double().abs().sum() for p in here.gpt_model.parameters()))
        assert child.weights_checksum() == checksum
        # one pass in flight at a time: a second request before the answer is a caller's error
        child.start([[1, 2, 3]], [1], 1.0)
        with pytest.raises(ReferenceProcessError, match="unanswered"):
            child.weights_checksum()
    finally:
        child.close()


FORK_CHECK = """
import os, signal, sys, time
import torch
from relax.config import parse_config
from relax.roles.reference_process import ReferenceProcess, ReferenceProcessError
sys.path.insert(0, {tests!r})
from test_reference_process import _inputs
torch.set_num_threads(1)
config = parse_config(["--hf-checkpoint", {model!r}, "--output-dir", {out!r}, "--use-kl-loss"])
inputs = _inputs(9)
forked, spawned = (ReferenceProcess(config, threads=1, fork=fork) for fork in (True, False))
def cmdline(pid):
    # read until the kernel shows one (empty while the process is still being set up on a loaded machine)
    for _ in range(50):
        with open(f"/proc/{{pid}}/cmdline", "rb") as f:
            args = f.read()
        if args:
            return args.split(b"\\0")
        time.sleep(0.1)
    return []
# a fork of this interpreter, not a new one (a library may retitle the process: its command line is not compared)
assert b"relax.roles.reference_child" in cmdline(spawned.pid), cmdline(spawned.pid)
assert b"relax.roles.reference_child" not in cmdline(forked.pid), cmdline(forked.pid)
rows = [child.compute_logprobs(inputs, 0.7) for child in (forked, spawned)]
assert all(torch.equal(a, b) for a, b in zip(*rows)), "forked rows differ"
assert forked.weights_checksum() == spawned.weights_checksum()
assert spawned.close() == 0
os.kill(forked.pid, signal.SIGKILL)
try:
    forked.compute_logprobs(inputs, 0.7)
except ReferenceProcessError as exc:
    assert f"pid {{forked.pid}} exited with code -9" in str(exc), exc
else:
    raise AssertionError("a killed forked child answered")
assert forked.close() == -9
late = ReferenceProcess(config, threads=1, fork=True)
late.start([x["tokens"].tolist() for x in inputs], [x["response_length"] for x in inputs], 1.0)
assert late.close() == 0  # no answer read: the pipe's end is the child's end, as a spawned child's
print("fork ok")
"""


def test_a_forked_child_gives_the_spawned_childs_rows_and_fails_alike(tmp_path, tiny_model):
    """The rank's constructor forks the child (relax.roles.forked_child): same rows and checksum, bitwise, as a
    fresh interpreter's; a killed child is named with its exit; the child ends when its pipe closes. Run in a
    fresh interpreter: this test process may have made an OpenMP thread team, after which a fork is not safe."""
    import subprocess
    import sys
    from pathlib import Path

    code = FORK_CHECK.format(tests=str(Path(__file__).parent), model=tiny_model, out=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "fork ok" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


def test_a_failed_build_is_the_first_requests_error(tmp_path, tiny_model):
    gone = tmp_path / "gone-model"
    shutil.copytree(tiny_model, gone)
    config = _config(tmp_path, str(gone))
    shutil.rmtree(gone)  # the folder went away after validation
    child = ReferenceProcess(config, threads=1)
    try:
        with pytest.raises(ReferenceProcessError, match="failed in the reference model's build") as err:
            child.compute_logprobs(_inputs(2), 1.0)
        assert "gone-model" in str(err.value)  # the child's own traceback, naming the cause
    finally:
        child.close()


def test_a_killed_child_is_named_with_its_exit(tmp_path, tiny_model):
    child = ReferenceProcess(_config(tmp_path, tiny_model), threads=1)
    try:
        child.weights_checksum()  # built and answering
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(ReferenceProcessError, match=rf"pid {child.pid} exited with code -9"):
            child.compute_logprobs(_inputs(2), 1.0)
    finally:
        child.close()


def test_the_child_ends_cleanly_when_the_rank_goes_before_its_answer(tmp_path, tiny_model):
    child = ReferenceProcess(_config(tmp_path, tiny_model), threads=1)
    inputs = _inputs(64)
    child.start([x["tokens"].tolist() for x in inputs], [x["response_length"] for x in inputs], 1.0)
    assert child.close() == 0  # no answer read: the child finds the pipe closed and exits without an error


def _state(trainer):
    from relax.backends.megatron.hf_weights import unwrap_model

    return [(k, v) for k, v in unwrap_model(trainer.model).state_dict().items() if isinstance(v, torch.Tensor)]


def test_parts_stream_in_order_under_the_rank_weights(tmp_path, tiny_model):
    """A pass asked in parts (relax.roles.step_passes) answers each part as computed, in the order asked: the
    reference rows from the reference, the old-policy rows from the weights the rank wrote for this pass."""
    config = _config(tmp_path, tiny_model, "--micro-batch-size", "4")
    child = ReferenceProcess(config, threads=1, with_policy=True)
    try:
        ensure_single_process()
        torch.set_num_threads(1)
        reference = build_reference_trainer(config)[0]
        policy = build_reference_trainer(config)[0]
        inputs = _inputs(10, seed=3)
        sequences, lengths = [x["tokens"].tolist() for x in inputs], [x["response_length"] for x in inputs]
        parts = parts_for(len(inputs), 4, with_old=True)
        assert parts == [(REFERENCE, 0, 4), (POLICY, 4, 10), (REFERENCE, 4, 10)]
        for round_ in range(2):  # the second pass sees the weights written for it, not the first pass's
            with torch.no_grad():
                for p in policy.gpt_model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            child.start(sequences, lengths, 0.8, parts=parts, policy=_state(policy))
            for kind, lo, hi in parts:
                part = child.next_part()
                assert (part.kind, part.lo, part.hi) == (kind, lo, hi) and part.start <= part.end
                model = reference if kind == REFERENCE else policy
                want = model.compute_logprobs(inputs[lo:hi], 0.8)
                assert all(torch.equal(a, b) for a, b in zip(part.rows, want)), (round_, kind)
            old = policy.compute_logprobs(inputs[4:], 0.8)
            assert not all(torch.equal(a, b) for a, b in zip(old, reference.compute_logprobs(inputs[4:], 0.8)))
        # a pass dropped after its first part (a failed stage): the next request's answers are its own
        child.start(sequences, lengths, 0.8, parts=parts, policy=_state(policy))
        child.next_part()
        child.drain()
        child.start(sequences[:3], lengths[:3], 0.8)
        rows, _, _ = child.result()
        assert all(torch.equal(a, b) for a, b in zip(rows, reference.compute_logprobs(inputs[:3], 0.8)))
        # old-policy rows without the weights are the caller's error, before anything is sent
        with pytest.raises(ReferenceProcessError, match="without the policy"):
            child.start(sequences, lengths, 0.8, parts=parts)
    finally:
        child.close()


def test_a_failing_part_ends_the_pass_and_the_process_goes_on(tmp_path, tiny_model):
    config = _config(tmp_path, tiny_model, "--micro-batch-size", "4")
    child = ReferenceProcess(config, threads=1, with_policy=True)
    try:
        inputs = _inputs(8)
        sequences, lengths = [x["tokens"].tolist() for x in inputs], [x["response_length"] for x in inputs]
        wrong = [("not.a.weight", torch.zeros(3))]
        child.start(sequences, lengths, 1.0, parts=parts_for(8, 4, with_old=True), policy=wrong)
        with pytest.raises(ReferenceProcessError, match="not.a.weight"):
            child.next_part()
        with pytest.raises(ReferenceProcessError, match="no pass in flight"):
            child.next_part()
        assert len(child.compute_logprobs(inputs[:2], 1.0)) == 2  # still answering
    finally:
        child.close()


def test_step_passes_wait_for_each_row_once(tmp_path, tiny_model):
    config = _config(tmp_path, tiny_model, "--micro-batch-size", "4")
    child = ReferenceProcess(config, threads=1)
    try:
        inputs = _inputs(12)
        sequences, lengths = [x["tokens"].tolist() for x in inputs], [x["response_length"] for x in inputs]
        passes = StepPasses.start(child, 3, sequences, lengths, 1.0, gbs=4, with_old=False)
        assert passes.parts == [(REFERENCE, 0, 4), (REFERENCE, 4, 8), (REFERENCE, 8, 12)]
        rows = passes.rows(REFERENCE)
        assert len(rows) == 12 and not passes.streams_old
        first = rows[5]  # waits for the first two parts, not the third
        assert len(passes.spans) == 2 and first.numel() == lengths[5]
        metrics = passes.finish()
        assert len(passes.spans) == 3 and metrics["perf/ref_logprob_time"] > 0
        assert [r.numel() for r in rows] == lengths
        whole = child.compute_logprobs(inputs, 1.0)
        assert all(torch.equal(a, b) for a, b in zip(rows, whole))  # parts give a whole pass's rows
    finally:
        child.close()


def test_which_runs_stream_old_policy_rows(tmp_path):
    default = parse_config(["--output-dir", str(tmp_path)])  # the embedded default: 4 updates, --use-kl-loss
    assert streams_old_logprobs(default)
    for extra in (["--kl-coef", "0.01", "--kl-loss-coef", "0"], ["--keep-old-actor"], ["--use-rollout-logprobs"],
                  ["--num-steps-per-rollout", "1"]):
        assert not streams_old_logprobs(parse_config(["--output-dir", str(tmp_path), *extra])), extra
    assert parts_for(4, 4, with_old=True) == [(REFERENCE, 0, 4)]
    assert parts_for(9, 4, with_old=False) == [(REFERENCE, 0, 4), (REFERENCE, 4, 9)]
