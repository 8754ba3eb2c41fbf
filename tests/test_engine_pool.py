"""The engine pool (relax.rollout.engine_pool) with real embedded engines on Ray and a router that records what
it is told: an engine added at run time gets the current weights (the pushed tensors, the pool's version)
before it joins the router; one that serves another version never joins; a killed or hung (SIGSTOP) engine
is found by the health monitor, leaves the router and is replaced, re-synced, on the same actor. A drained
engine leaves the router once; an addition is refused while the pool closes, and one under way at shutdown or
cancelled stops the engine it was starting."""

import os
import signal
import time
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from conftest import assert_ray_released

from relax.wire.engine_client import EngineClient
from relax.roles.engine import EngineActor
from relax.rollout.engine_pool import ACTIVE, EnginePool, HealthMonitor

SERVER_ARGS = {"dtype": "float32", "random_seed": 0, "num_threads": 1, "max_running_requests": 8}


class Router:
    """Records membership changes, in order, with the weight version each engine serves at that moment."""

    def __init__(self):
        self.log = []

    def add_worker(self, url):
        self.log.append(("add", url, EngineClient(url, timeout_s=10).get_weight_version()))

    def remove_worker(self, url):
        self.log.append(("remove", url, None))

    def workers(self):
        now = []
        for op, url, _ in self.log:
            now = now + [url] if op == "add" else [u for u in now if u != url]
        return now


@ray.remote
class WeightSource:
    """Stands in for trainer rank 0: keeps the weights of the 'last push' and pushes them to given engines."""

    def __init__(self, named, version):
        self.named, self.version, self.pushes = named, version, []

    def push_kept_weights(self, urls):
        from relax.weights.sync import push_named_tensors

        self.pushes.append(list(urls))
        report = push_named_tensors(self.named, urls, self.version, 1 << 20, timeout_s=60)
        return {**report, "version": self.version}

    def calls(self):
        return self.pushes


def perturbed_weights(model_dir):
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    return [(name, t + 0.5) for name, t in sorted(tensors.items())]


def make_pool(model_dir, tmp_path, router):
    def make_actor(engine_id, placement):
        return EngineActor.options(num_cpus=0).remote("embedded", model_dir, SERVER_ARGS, 1, str(tmp_path), engine_id)

    return EnginePool(router, make_actor=make_actor, control_timeout_s=30, start_timeout_s=180, sync_timeout_s=120)


def test_added_engine_gets_current_weights_before_it_joins(ray_session, tiny_model, tmp_path):
    router = Router()
    pool = make_pool(tiny_model, tmp_path, router)
    named = perturbed_weights(tiny_model)
    try:
        pool.start_initial([None])
        first = pool.urls()[0]
        assert router.log == [("add", first, "default")]  # --hf-checkpoint, before any push
        # a push of version 3 happened (to the first engine); the pool knows it, trainer rank 0 kept the weights
        source = WeightSource.options(num_cpus=0).remote(named, 3)
        ray.get(source.push_kept_weights.remote([first]))
        pool.set_weight_version(3, [first])
        pool.weight_source = source

        (added,) = pool.add(1)
        assert ray.get(source.calls.remote())[-1] == [added]
        assert router.log[-1] == ("add", added, "3")  # it served version 3 when it joined the router
        assert pool.by_url(added).state == ACTIVE and pool.by_url(added).weight_version == "3"
        client = EngineClient(added, timeout_s=30)
        name, tensor = named[0]
        served = torch.tensor(client.get_weights_by_name(name, truncate_size=10 ** 9)).reshape(tensor.shape)
        assert torch.allclose(served, tensor.float())
        kinds = [e["kind"] for e in pool.events if e.get("url") == added]
        assert kinds == ["engine_synced", "engine_registered", "engine_added"]

        # the version moved on without this source: an engine that cannot be brought to it never joins
        pool.set_weight_version(4, [])
        with pytest.raises(RuntimeError, match="serves weight version '3'"):
            pool.add(1)
        assert router.workers() == [first, added] and len(pool.list()) == 2

        # scale-in: off the router first, then stopped once it holds no request
        assert pool.drain(added, timeout_s=10)
        assert router.workers() == [first] and [e["url"] for e in pool.list()] == [first]
        assert not EngineClient(added, timeout_s=2).health(timeout_s=2)
    finally:
        pool.shutdown()
    assert_ray_released()


# SIGSTOP here (a hung engine must be killed, not left stopped); a killed one: tests/test_engine_fault_tolerance.py
@pytest.mark.parametrize("fault", ["hang"])
def test_failed_engine_leaves_the_router_and_is_replaced(ray_session, tiny_model, tmp_path, fault):
    router = Router()
    pool = make_pool(tiny_model, tmp_path, router)
    named = perturbed_weights(tiny_model)
    monitor = None
    try:
        pool.start_initial([None, None])
        a, b = pool.urls()
        source = WeightSource.options(num_cpus=0).remote(named, 5)
        ray.get(source.push_kept_weights.remote([a, b]))
        pool.set_weight_version(5, [a, b])
        pool.weight_source = source
        monitor = HealthMonitor(pool, interval_s=0.5, timeout_s=2.0).start()
        victim = pool.by_url(b)
        pid = ray.get(victim.actor.pid.remote())
        t0 = time.time()
        os.killpg(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        deadline = time.monotonic() + 120
        while not any(e["kind"] == "engine_replaced" for e in pool.events) and time.monotonic() < deadline:
            time.sleep(0.1)
        failed = next(e for e in pool.events if e["kind"] == "engine_failed")
        replaced = next(e for e in pool.events if e["kind"] == "engine_replaced")
        # found within one interval plus one probe timeout (plus scheduling slack on a loaded machine)
        assert failed["url"] == b and failed["time"] - t0 < 0.5 + 2.0 + 3.0
        assert ("remove", b, None) in router.log
        new = replaced["url"]
        assert new != b and router.log[-1] == ("add", new, "5")  # re-synced before it joined
        assert sorted(router.workers()) == sorted([a, new])
        assert ray.get(victim.actor.pid.remote()) != pid  # a new server on the same actor
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the hung server was killed, not left stopped
        print(f"{fault}: detected after {failed['time'] - t0:.2f} s, replaced {replaced['time'] - failed['time']:.2f} s "
              "later")
    finally:
        if monitor is not None:
            monitor.stop()
        pool.shutdown()
    assert_ray_released()


def test_push_targets_leave_out_a_dead_engine_and_probes_pause_during_a_push():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    live, dead = f"http://127.0.0.1:{server.server_address[1]}", "http://127.0.0.1:9"
    try:
        pool = EnginePool(Router.__new__(Router), control_timeout_s=2)
        for url in (live, dead):
            pool._new_record().url = url
        for e in pool.engines.values():
            e.state = ACTIVE
        assert pool.push_targets() == [live, dead]  # without fault tolerance a dead engine fails the push itself
        pool.set_weight_version(1, [live, dead])

        monitor = HealthMonitor(pool, interval_s=1, timeout_s=2)
        found = []
        pool.on_failure = monitor.handle = lambda e, reason: found.append((e.url, reason))
        assert pool.push_targets() == [live] and found == [(dead, "no answer to /health before a weight push")]
        assert pool.pushing and monitor.probe_once() == []  # no probe while the push is under way
        pool.set_weight_version(2, [live])
        assert not pool.pushing and monitor.probe_once() == [dead]
        assert pool.by_url(live).weight_version == "2" and pool.weight_version == "2"
    finally:
        server.shutdown()


def test_a_replacement_under_way_at_shutdown_leaves_no_server(ray_session, tiny_model, tmp_path):
    import psutil

    seed = 918273  # marks this test's servers' command lines

    def servers():
        return [p for p in psutil.process_iter(["cmdline"])
                if "relax.backends.embedded.server" in " ".join(p.info["cmdline"] or [])
                and str(seed) in (p.info["cmdline"] or [])]

    def make_actor(engine_id, placement):
        return EngineActor.options(num_cpus=0).remote("embedded", tiny_model, {**SERVER_ARGS, "random_seed": seed},
                                                      1, str(tmp_path), engine_id)

    pool = EnginePool(Router(), make_actor=make_actor, control_timeout_s=30, start_timeout_s=180)
    monitor = HealthMonitor(pool, interval_s=60, timeout_s=2.0)
    try:
        pool.start_initial([None])
        (engine,) = pool.engines.values()
        monitor.handle(engine, "test")  # taken out; its replacement starts in the background
        time.sleep(1.0)  # the new server is starting
    finally:
        monitor.stop(wait_s=120)
        pool.shutdown()
    deadline = time.monotonic() + 15
    while servers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert servers() == []
    assert [e["kind"] for e in pool.events][-1] == "engine_replace_failed"
    assert_ray_released()


# ---------------------------------------------------------------- leaving once; additions refused or abandoned
class StrictRouter(Router):
    """Like the real router: removing a URL that is not a worker fails."""

    def remove_worker(self, url):
        if url not in self.workers():
            raise RuntimeError(f"{url} is not a worker of the router")
        super().remove_worker(url)


def fake_engine_server():
    """An HTTP server answering an engine's control reads (weight version, load, health); returns (server, url)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/get_weight_version": {"weight_version": "default"},
                    "/get_load": [{"dp_rank": 0, "num_reqs": 0}]}.get(self.path.split("?")[0], {})
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@ray.remote(num_cpus=0)
class FakeEngineActor:
    """An EngineActor whose `start` takes `start_s` and reports `url` (one call at a time, like the real one)."""

    def __init__(self, url, start_s=0.0):
        self.url, self.start_s = url, start_s

    def start(self):
        time.sleep(self.start_s)
        return self.url

    def shutdown(self):
        pass

    def ping(self):
        return True


def assert_actor_gone(actor, timeout_s=30.0):
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.ping.remote(), timeout=timeout_s)


def test_a_drained_engine_leaves_the_router_once(caplog):
    server, url = fake_engine_server()
    router = StrictRouter()
    router.add_worker = lambda u: router.log.append(("add", u, "default"))
    try:
        pool = EnginePool(router, control_timeout_s=5)
        e = pool._new_record()
        e.url = url
        pool._register(e)
        with caplog.at_level("WARNING", logger="relax.rollout.engine_pool"):
            assert pool.drain(url, timeout_s=5)
        assert [op for op in router.log if op[0] == "remove"] == [("remove", url, None)]
        assert "is not a worker" not in caplog.text
        assert pool.list() == []
    finally:
        server.shutdown()


def test_add_is_refused_once_the_pool_is_closing():
    made = []
    pool = EnginePool(Router(), make_actor=lambda i, p: made.append(i))
    pool.closing = True
    with pytest.raises(RuntimeError, match="shutting down"):
        pool.add(1)
    assert made == [] and pool.list() == [] and pool.router.log == []


def test_an_add_under_way_at_shutdown_leaves_no_engine(ray_session):
    import threading

    server, url = fake_engine_server()
    router, actors, shut = Router(), [], threading.Event()

    def make_actor(engine_id, placement):  # the actor is made while the pool shuts down
        shut.wait(10)
        actors.append(FakeEngineActor.remote(url))
        return actors[-1]

    pool = EnginePool(router, make_actor=make_actor, control_timeout_s=5, start_timeout_s=30)
    errors = []
    adding = threading.Thread(target=lambda: errors.append(_raised(pool.add, 1)))
    try:
        adding.start()
        time.sleep(0.3)
        pool.shutdown()
        shut.set()
        adding.join(30)
        assert not adding.is_alive()
        assert errors and "shutting down" in str(errors[0])
        assert router.log == [] and pool.list() == []  # it never joined the router, nor stayed in the pool
        assert_actor_gone(actors[0])
    finally:
        shut.set()
        server.shutdown()


def slow_start_pool(start_s: float = 20.0):
    """(pool, router, actors made, fake server) of a pool whose engines take `start_s` to start."""
    server, url = fake_engine_server()
    router, actors = Router(), []

    def make_actor(engine_id, placement):
        actors.append(FakeEngineActor.remote(url, start_s=start_s))
        return actors[-1]

    return EnginePool(router, make_actor=make_actor, control_timeout_s=5, start_timeout_s=60), router, actors, server


def test_a_cancelled_add_stops_the_engine_it_was_starting(ray_session):
    import threading

    pool, router, actors, server = slow_start_pool()
    cancel = threading.Event()
    threading.Timer(1.0, cancel.set).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="cancelled"):
            pool.add(1, cancel=cancel)
        assert time.monotonic() - t0 < 1.0 + 5.0  # at the cancel, not when the start would have ended
        assert router.log == [] and pool.list() == []
        assert [e["kind"] for e in pool.events] == ["engine_add_abandoned"]
        assert_actor_gone(actors[0], timeout_s=10)  # killed while starting: its shutdown would wait behind start
    finally:
        server.shutdown()


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as exc:
        return exc
    return None
