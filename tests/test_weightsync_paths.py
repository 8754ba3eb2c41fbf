"""The three weight-sync paths behind `relax.weights.sync.WeightSync` against a real embedded engine:
tensor (shared memory), disk (safetensors + /update_weights_from_disk) and distributed (gloo broadcast);
each versioned and, with check_equal, verified tensor by tensor; failures and timeouts name the engine."""

from __future__ import annotations

import socket

import pytest
import torch

from conftest import shared_tiny_model

from relax.backends.embedded.launcher import EmbeddedServerProcess
from relax.backends.embedded.testing import (
    load_reference_model,
    max_abs_diff,
    perturbed_state_dict,
    reference_logprobs,
    response_logprobs,
)
from relax.backends.engine_client import EngineClient
from relax.weights.sync import (
    WeightSyncError,
    close_all,
    make_weight_sync,
    push_named_tensors,
)

PROMPT = [12, 34, 56, 78, 90, 11]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(shared_tiny_model())


@pytest.fixture(scope="module")
def server(model_dir):
    proc = EmbeddedServerProcess(model_dir, server_args={"random_seed": 0})
    proc.start()
    try:
        proc.wait_healthy(120)
        yield proc
    finally:
        close_all()
        proc.stop()


def _serves(url, model_dir, named, version):
    ref = load_reference_model(model_dir)
    sd = dict(named)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(sd[n])
    client = EngineClient(url, timeout_s=60)
    try:
        r = client.generate(PROMPT, {"temperature": 0.8, "max_new_tokens": 8, "ignore_eos": True},
                            return_logprob=True)
    finally:
        client.close()
    assert r["meta_info"]["weight_version"] == str(version)
    assert max_abs_diff(response_logprobs(r), reference_logprobs(ref, PROMPT, r["output_ids"], 0.8)) <= 1e-5


@pytest.mark.parametrize("method", ["tensor", "disk", "distributed"])
def test_each_path_updates_versions_and_verifies(server, model_dir, method):
    base = load_reference_model(model_dir)
    with make_weight_sync(method, [server.url], buffer_bytes=64 << 10, timeout_s=60, check_equal=True,
                          source_dir=model_dir) as sync:
        for i, seed in enumerate((11, 12)):  # twice: a kept distributed group / staging buffers are reused
            named = perturbed_state_dict(base, seed=seed + 10 * len(method))
            version = f"{method}-{i}"
            report = sync.push(named, version)
            assert report["method"] == method and report["engines"] == 1
            assert report["bytes"] == sum(t.numel() * t.element_size() for _, t in named)
            _serves(server.url, model_dir, named, version)


def test_push_named_tensors_delegates_and_check_equal_catches_differences(server, model_dir):
    base = load_reference_model(model_dir)
    named = perturbed_state_dict(base, seed=3)
    report = push_named_tensors(named, [server.url], 7, 1 << 20, check_equal=True)
    assert report["engines"] == 1 and report["bytes_per_s"] > 0
    # the engine now holds something else under the same version: the exhaustive check names it
    client = EngineClient(server.url, timeout_s=60)
    tampered = [(n, t + 1.0 if n.endswith("norm.weight") else t) for n, t in named]
    client.update_weights_from_tensor(tampered, weight_version="7")
    client.close()
    sync = make_weight_sync("tensor", [server.url], check_equal=True)
    with pytest.raises(WeightSyncError, match=rf"engine {server.url} holds weights different.*norm.weight"):
        sync.verify(named, "7")
    sync.close()


def test_failures_and_timeouts_name_the_engine(server, model_dir):
    base = load_reference_model(model_dir)
    named = perturbed_state_dict(base, seed=4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed once the block ends: refused connections
    for method in ("tensor", "disk"):
        with pytest.raises(WeightSyncError, match=dead):
            make_weight_sync(method, [server.url, dead], timeout_s=10).push(named, 1)
    with socket.socket() as hang:  # accepts connections (backlog) but never answers
        hang.bind(("127.0.0.1", 0))
        hang.listen(8)
        url = f"http://127.0.0.1:{hang.getsockname()[1]}"
        with pytest.raises(WeightSyncError, match=rf"{url}.*timed out"):
            make_weight_sync("tensor", [url], timeout_s=1).push(named, 2)
    bad = [(n + ".nope" if i == 0 else n, t) for i, (n, t) in enumerate(named)]
    with pytest.raises(WeightSyncError, match=rf"{server.url}.*unknown parameter names"):
        make_weight_sync("disk", [server.url], timeout_s=30).push(bad, 3)
