"""The three weight-sync paths behind `relax.weights.sync.WeightSync` against a real embedded engine:
tensor (shared memory), disk (safetensors + /update_weights_from_disk) and distributed (gloo broadcast);
each versioned and, with check_equal, verified tensor by tensor; failures and timeouts name the engine."""

from __future__ import annotations

import socket

import pytest

from engine_fixtures import assert_engine_serves

from relax.backends.embedded.testing import load_reference_model, perturbed_state_dict
from relax.wire.engine_client import EngineClient
from relax.weights.sync import (
    WeightSyncError,
    close_all,
    make_weight_sync,
    push_named_tensors,
)


@pytest.fixture(scope="module")
def server(server):
    """The embedded engine server of tests/engine_fixtures.py; the weight syncs' groups closed before it stops."""
    yield server
    close_all()


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
            assert_engine_serves(server.url, model_dir, named, version)


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
