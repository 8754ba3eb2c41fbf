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
from relax.roles.reference_process import ReferenceProcess, ReferenceProcessError
from relax.roles.megatron_settings import build_reference_trainer


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
