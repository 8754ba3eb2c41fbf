"""The real sglang-router in front of two embedded engines: dynamic membership and routing."""

import os

import pytest
import requests

from relax.backends.embedded.launcher import EmbeddedServerProcess
from relax.backends.embedded.testing import load_reference_model, perturbed_state_dict, reference_greedy
from relax.wire.engine_client import EngineClient, update_weights_from_tensor_many
from relax.backends.sglang.router import RouterError, RouterProcess

T = 30


@pytest.fixture(scope="module")
def engines(model_dir):
    procs = [EmbeddedServerProcess(model_dir, server_args={"random_seed": i}) for i in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_healthy(90)
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def router():
    r = RouterProcess("127.0.0.1", policy="round_robin")
    try:
        r.start()
        yield r
    finally:
        r.stop()


def finished(engine) -> int:
    info = requests.get(engine.url + "/get_server_info", timeout=T).json()
    return info["internal_states"][0]["num_requests_finished"]


def test_router_starts_empty_and_routes_to_both(router, engines):
    assert router.list_workers() == []
    for e in engines:
        router.add_worker(e.url)
    assert sorted(router.worker_urls()) == sorted(e.url for e in engines)
    before = [finished(e) for e in engines]
    client = EngineClient(router.url, timeout_s=T)
    for i in range(8):
        r = client.generate([i + 1, 2, 3], {"max_new_tokens": 4, "ignore_eos": True}, return_logprob=True)
        assert len(r["output_ids"]) == 4 and len(r["meta_info"]["output_token_logprobs"]) == 4
    delta = [finished(e) - b for e, b in zip(engines, before)]
    assert delta == [4, 4], delta  # round robin is exact
    # sglang-router 0.3.2 fans /flush_cache out to its workers without presenting its --api-key, so the
    # engines refuse it (206, "HTTP 401" per worker); Relax flushes each engine with its own client.
    assert requests.post(router.url + "/flush_cache", timeout=T).status_code == 401  # the router wants the key
    for e in engines:
        EngineClient(e.url, timeout_s=T).flush_cache()


def test_removed_worker_gets_no_traffic(router, engines):
    if len(router.worker_urls()) < 2:
        for e in engines:
            if e.url not in router.worker_urls():
                router.add_worker(e.url)
    router.remove_worker(engines[1].url)
    assert router.worker_urls() == [engines[0].url]
    before = [finished(e) for e in engines]
    client = EngineClient(router.url, timeout_s=T)
    batch = client.generate([[1, 2], [3, 4], [5, 6]], {"max_new_tokens": 3, "ignore_eos": True})
    assert len(batch) == 3
    for _ in range(4):
        client.generate([7, 8], {"max_new_tokens": 2, "ignore_eos": True})
    delta = [finished(e) - b for e, b in zip(engines, before)]
    assert delta[1] == 0 and delta[0] == 7, delta
    with pytest.raises(RouterError):
        router.remove_worker(engines[1].url)  # no longer a member
    router.add_worker(engines[1].url)  # and it can come back
    assert len(router.worker_urls()) == 2


def test_push_weights_to_both_engines_once(engines, model_dir):
    new = perturbed_state_dict(load_reference_model(model_dir), seed=11)
    clients = [EngineClient(e.url, timeout_s=T) for e in engines]
    stats = update_weights_from_tensor_many(clients, new, weight_version="both-11", buffer_bytes=128 << 10)
    assert stats["num_engines"] == 2 and stats["num_requests"] > 1
    ref = load_reference_model(model_dir)
    ref.load_state_dict(dict(new), strict=False)
    expected = reference_greedy(ref, [1, 2, 3], 10)
    for c in clients:
        assert c.get_weight_version() == "both-11"
        assert c.generate([1, 2, 3], {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True})["output_ids"] == expected


def test_stop_leaves_no_process(model_dir):
    r = RouterProcess("127.0.0.1").start()
    e = EmbeddedServerProcess(model_dir, server_args={"random_seed": 0}).start()
    pids = [r.pid, e.pid]
    try:
        e.wait_healthy(90)
        r.add_worker(e.url)
    finally:
        e.stop()
        r.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # neither the leader nor anything of its group is left
    with pytest.raises(requests.ConnectionError):
        requests.get(r.url + "/health", timeout=2)


PARENT = """
import sys, time
from relax.backends.sglang.router import RouterProcess
r = RouterProcess("127.0.0.1").start()
print(r.url, r.pid, flush=True)
time.sleep(300)
"""


def test_router_exits_when_its_parent_is_killed():
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    group = None
    try:
        url, pid = parent.stdout.readline().split()
        group = int(pid)
        assert requests.get(url + "/health", timeout=T).status_code == 200
        parent.kill()  # no stop(), no atexit: only the watchdog can clean up
        parent.wait(10)
        deadline = time.monotonic() + 15
        while True:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "router outlived its parent"
            time.sleep(0.1)
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=2)
    finally:
        if parent.poll() is None:
            parent.kill()
        if group is not None:
            try:
                os.killpg(group, 9)
            except ProcessLookupError:
                pass
