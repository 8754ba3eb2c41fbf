"""The embedded engine's fixtures and helpers (tests that start the engine in this process or as a server).
Registered for every test by tests/conftest.py (`pytest_plugins`); the engine serves the module's `model_dir`
(tests/conftest.py)."""

import pytest

PROMPT = [12, 34, 56, 78, 90, 11]


@pytest.fixture(scope="module")
def ref(model_dir):
    """The HF model of `model_dir`, in this process: what the engine's tokens and log-probs are checked against."""
    from relax.backends.embedded.testing import load_reference_model

    return load_reference_model(model_dir)


@pytest.fixture(scope="module")
def server(request, model_dir):
    """An embedded engine server (a process, over HTTP) on `model_dir` with random seed 0 and the module's
    `SERVER_ARGS` (more server arguments, where it sets them), started once for the module."""
    from relax.backends.embedded.launcher import EmbeddedServerProcess

    proc = EmbeddedServerProcess(model_dir, server_args={"random_seed": 0, **getattr(request.module, "SERVER_ARGS", {})})
    proc.start()
    try:
        proc.wait_healthy(120)
        yield proc
    finally:
        proc.stop()


def reference_with(model_dir, named):
    """The HF model of `model_dir` with the weights `named` ((name, tensor) pairs) copied in."""
    import torch

    from relax.backends.embedded.testing import load_reference_model

    ref = load_reference_model(model_dir)
    sd = dict(named)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(sd[n])
    return ref


def assert_engine_serves(url, model_dir, named, version):
    """The engine at `url` serves the weights `named` at weight version `version`: its log-probs of a sampled reply
    are the HF model's with those weights (within 1e-5)."""
    from relax.backends.embedded.testing import max_abs_diff, reference_logprobs, response_logprobs
    from relax.wire.engine_client import EngineClient

    ref = reference_with(model_dir, named)
    client = EngineClient(url, timeout_s=60)
    try:
        r = client.generate(PROMPT, {"temperature": 0.8, "max_new_tokens": 8, "ignore_eos": True},
                            return_logprob=True)
    finally:
        client.close()
    assert r["meta_info"]["weight_version"] == str(version)
    assert max_abs_diff(response_logprobs(r), reference_logprobs(ref, PROMPT, r["output_ids"], 0.8)) <= 1e-5
