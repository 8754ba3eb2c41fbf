"""The engine's door: crafted weight payloads run nothing, control endpoints need the run's key, engines
listen on loopback on one node, and checkpoint files that would run code are refused."""

import base64
import os
import pickle
import tempfile

import pytest
import requests
import torch

from conftest import shared_ray, shared_tiny_model

from relax.wire.auth import OPEN_ENDPOINTS, auth_headers, authorized, ensure_engine_api_key
from relax.backends.embedded.launcher import EmbeddedServerProcess
from relax.backends.megatron.checkpoint import load_state_file
from relax.wire.serialize import deserialize_named_tensors, restricted_loads, serialize_named_tensors


def _marker() -> str:
    fd, path = tempfile.mkstemp(prefix="relax-pwned-")
    os.close(fd)
    os.unlink(path)
    return path


def _global_dotted(marker: str) -> bytes:
    """GLOBAL with a dotted name under protocol 4: `torch` + `os.system` resolves to os.system."""
    return b"\x80\x04" + f"ctorch\nos.system\n(Vtouch {marker}\ntR.".encode()


def _stack_global_dotted(marker: str) -> bytes:
    """Protocol 4 STACK_GLOBAL with a dotted name (what a `torch`-module allow-list let through)."""
    frame = (b"\x8c\x05torch\x94\x8c\tos.system\x94\x93\x94"
             + b"\x8c" + bytes([len(f"touch {marker}")]) + f"touch {marker}".encode() + b"\x94\x85\x94R\x94.")
    return b"\x80\x04" + frame


class _ReduceBuiltin:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({self.marker!r}, 'w').close()",))


class _ReduceSystem:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


CRAFTED = {
    "global-dotted": _global_dotted,
    "stack-global-dotted": _stack_global_dotted,
    "reduce-eval": lambda m: pickle.dumps(_ReduceBuiltin(m), protocol=2),
    "reduce-os-system": lambda m: pickle.dumps(_ReduceSystem(m), protocol=4),
    "tensor-then-system": lambda m: pickle.dumps([("w", torch.zeros(2)), _ReduceSystem(m)], protocol=4),
}


@pytest.mark.parametrize("kind", sorted(CRAFTED))
def test_crafted_payloads_are_refused_and_run_nothing(kind):
    marker = _marker()
    payload = CRAFTED[kind](marker)
    if kind.endswith("dotted"):  # the payload is live: a plain unpickler would run it
        assert pickle.loads(payload) == 0 and os.path.exists(marker)
        os.unlink(marker)
    with pytest.raises(pickle.UnpicklingError):
        restricted_loads(base64.b64encode(payload).decode())
    assert not os.path.exists(marker)


def test_real_payloads_still_load():
    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16))]
    for fmt in ("flattened_bucket", None):
        for name, tensor in named:
            data, keep = serialize_named_tensors([(name, tensor)], fmt)
            ((got_name, got),) = deserialize_named_tensors(data, fmt)
            assert got_name == name and torch.equal(got, tensor)
            del keep


def test_authorized_compares_bearer_tokens():
    assert authorized("Bearer k1", "k1") and authorized("bearer k1", "k1")
    assert not authorized("Bearer k2", "k1") and not authorized(None, "k1") and not authorized("k1", "k1")
    assert not authorized("Bearer ", "") and not authorized("Bearer x", None)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ensure_engine_api_key()
    model = shared_tiny_model()
    proc = EmbeddedServerProcess(str(model))
    try:
        proc.start()
        proc.wait_healthy(120)
        yield proc
    finally:
        proc.stop()


CONTROL = ["/update_weights_from_tensor", "/update_weights_from_disk", "/release_memory_occupation",
           "/resume_memory_occupation", "/pause_generation", "/continue_generation", "/abort_request",
           "/flush_cache", "/init_weights_update_group", "/update_weight_version", "/get_weights_by_name",
           "/destroy_weights_update_group", "/update_weights_from_distributed"]


def test_control_endpoints_need_the_key(engine):
    assert not set(CONTROL) & OPEN_ENDPOINTS
    for path in CONTROL:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = requests.post(engine.url + path, json={}, headers=headers, timeout=30)
            assert resp.status_code == 401, (path, resp.status_code, resp.text)
    # The engine still serves: the unauthenticated release did nothing.
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    assert requests.post(engine.url + "/generate", json=body, timeout=60).status_code == 200
    assert requests.get(engine.url + "/health_generate", timeout=60).status_code == 200
    resp = requests.post(engine.url + "/flush_cache", headers=auth_headers(), timeout=30)
    assert resp.status_code == 200


def test_crafted_payload_over_http_runs_nothing(engine):
    marker = _marker()
    entry = base64.b64encode(_stack_global_dotted(marker)).decode()
    body = {"serialized_named_tensors": [entry], "load_format": None}
    assert requests.post(engine.url + "/update_weights_from_tensor", json=body, timeout=30).status_code == 401
    resp = requests.post(engine.url + "/update_weights_from_tensor", json=body, headers=auth_headers(), timeout=30)
    assert resp.status_code == 400 and "refusing to unpickle" in resp.json()["message"]
    assert not os.path.exists(marker)


def test_engine_without_a_key_disables_control(tmp_path):
    from fastapi.testclient import TestClient

    from relax.backends.embedded.server import create_app

    app = create_app(engine=None, api_key=None)  # the middleware answers before any engine is touched
    client = TestClient(app)
    resp = client.post("/release_memory_occupation", json={})
    assert resp.status_code == 401 and "without an API key" in resp.json()["message"]


def test_engine_binds_loopback_on_one_node():
    from relax.roles.engine import engine_bind_host

    assert engine_bind_host() == "127.0.0.1"  # no Ray yet, or the session's
    shared_ray()
    assert engine_bind_host() == "127.0.0.1"  # a one-node cluster


def test_checkpoint_that_would_run_code_is_refused(tmp_path):
    marker = _marker()
    bad = tmp_path / "rank00000.pt"
    torch.save({"model": {}, "rng": _ReduceSystem(marker)}, bad)
    with pytest.raises(ValueError, match="could run code"):
        load_state_file(bad, iteration=3)
    assert not os.path.exists(marker)


def test_checkpoint_rng_state_loads_safely(tmp_path):
    """The NumPy RNG state is stored as a tensor; checkpoints that hold it as an array still load."""
    import numpy as np

    from relax.backends.megatron.checkpoint import _numpy_state_from_safe, _numpy_state_to_safe

    state = np.random.get_state()
    path = tmp_path / "state.pt"
    torch.save({"numpy": _numpy_state_to_safe(state), "legacy_numpy": state}, path)
    loaded = load_state_file(path)
    for got in (_numpy_state_from_safe(loaded["numpy"]), loaded["legacy_numpy"]):
        assert got[0] == "MT19937" and np.array_equal(got[1], state[1]) and got[2:] == state[2:]


def test_truncated_checkpoint_names_file_and_iteration(tmp_path):
    path = tmp_path / "rank00000.pt"
    torch.save({"model": {"w": torch.zeros(1000)}}, path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(ValueError, match=r"rank00000.pt \(iteration 7\) is damaged or truncated"):
        load_state_file(path, iteration=7)


def test_router_starts_with_a_key_that_reads_like_an_option(monkeypatch):
    """A key is one `--api-key=KEY` token: a key starting with "-" once made sglang-router's parser exit (1 in
    64 url-safe keys did), failing every engine start of that run. Keys made by Relax are hex."""
    from relax.wire.auth import ENGINE_API_KEY_ENV
    from relax.backends.sglang.router import RouterProcess

    monkeypatch.delenv(ENGINE_API_KEY_ENV, raising=False)
    made = ensure_engine_api_key()
    assert len(made) == 64 and int(made, 16) >= 0
    monkeypatch.setenv(ENGINE_API_KEY_ENV, "-looks-like-an-option_0")
    router = RouterProcess("127.0.0.1", policy="round_robin")
    try:
        router.start()
        assert router.list_workers() == []
    finally:
        router.stop()
