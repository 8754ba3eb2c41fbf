"""remote_rm against a local aiohttp server on 127.0.0.1: success, retries, permanent failure."""

import asyncio
import socket
import threading
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from relax.rollout.rewards import RemoteRewardError, RemoteRewardModel, RewardError, get_reward_fn, score_samples


class _Server:
    """aiohttp app in a background thread. Routes:
    /ok     -> {"reward": 1 if response == label else 0, "echo": metadata}
    /flaky  -> 503 for the first `fail_times` requests, then like /ok
    /down   -> always 500
    /bad    -> 400 (not retried)
    /number -> a bare JSON number
    /slow   -> sleeps longer than the client timeout
    """

    def __init__(self):
        self.hits = {}
        self.fail_times = 2
        self.loop = asyncio.new_event_loop()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self._ready.wait(10)

    def url(self, route):
        return f"http://127.0.0.1:{self.port}/{route}"

    def _count(self, name):
        self.hits[name] = self.hits.get(name, 0) + 1
        return self.hits[name]

    async def ok(self, request):
        self._count("ok")
        body = await request.json()
        return web.json_response({"reward": 1.0 if body["response"] == body["label"] else 0.0, "echo": body["metadata"]})

    async def flaky(self, request):
        if self._count("flaky") <= self.fail_times:
            return web.Response(status=503, text="warming up")
        body = await request.json()
        return web.json_response({"reward": 1.0 if body["response"] == body["label"] else 0.0})

    async def down(self, request):
        self._count("down")
        return web.Response(status=500, text="internal error")

    async def bad(self, request):
        self._count("bad")
        return web.Response(status=400, text="bad request")

    async def number(self, request):
        return web.json_response(0.25)

    async def slow(self, request):
        self._count("slow")
        await asyncio.sleep(1)
        return web.json_response(1.0)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        for name in ("ok", "flaky", "down", "bad", "number", "slow"):
            app.router.add_post(f"/{name}", getattr(self, name))
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.SockSite(self.runner, self.sock).start())
        self._ready.set()
        self.loop.run_forever()

    def stop(self):
        async def _cleanup():
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(_cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    s = _Server()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _reset(server):
    server.hits.clear()
    server.fail_times = 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAST = dict(backoff=0.01, max_backoff=0.02, timeout=5)


@dataclass
class Sample:
    response: str
    label: object = None
    metadata: dict = field(default_factory=dict)


def test_success_sync_and_async(server):
    rm = get_reward_fn("remote_rm", rm_url=server.url("ok"), **FAST)
    assert rm("x", "x", {"k": 1}) == {"reward": 1.0, "echo": {"k": 1}}
    assert asyncio.run(rm.acall("x", "y", {})) == {"reward": 0.0, "echo": {}}
    assert RemoteRewardModel(server.url("number"))("a", "b", {}) == 0.25


def test_url_from_metadata(server):
    rm = get_reward_fn("remote_rm", **FAST)
    assert rm("x", "x", {"rm_url": server.url("ok")})["reward"] == 1.0
    with pytest.raises(RemoteRewardError, match="needs a URL"):
        rm("x", "x", {})


def test_retries_then_success(server):
    rm = RemoteRewardModel(server.url("flaky"), max_retries=3, **FAST)
    assert rm("x", "x", {}) == {"reward": 1.0}
    assert server.hits["flaky"] == 3
    server.hits.clear()
    assert asyncio.run(rm.acall("x", "x", {})) == {"reward": 1.0}
    assert server.hits["flaky"] == 3


def test_permanent_failure_names_url(server):
    url = server.url("down")
    rm = RemoteRewardModel(url, max_retries=2, **FAST)
    with pytest.raises(RemoteRewardError, match=rf"{url} failed after 3 attempt\(s\).*HTTP 500"):
        rm("x", "x", {})
    assert server.hits["down"] == 3
    with pytest.raises(RemoteRewardError, match=rf"{url} failed after 3 attempt\(s\).*HTTP 500"):
        asyncio.run(rm.acall("x", "x", {}))


def test_client_error_is_not_retried(server):
    url = server.url("bad")
    with pytest.raises(RemoteRewardError, match=rf"{url} failed after 1 attempt\(s\).*HTTP 400"):
        RemoteRewardModel(url, max_retries=3, **FAST)("x", "x", {})
    assert server.hits["bad"] == 1


def test_connection_refused_and_timeout():
    url = f"http://127.0.0.1:{_free_port()}/score"
    rm = RemoteRewardModel(url, max_retries=1, **FAST)
    with pytest.raises(RemoteRewardError, match=rf"{url} failed after 2 attempt"):
        rm("x", "x", {})
    with pytest.raises(RemoteRewardError, match=rf"{url} failed after 2 attempt"):
        asyncio.run(rm.acall("x", "x", {}))


def test_timeout(server):
    url = server.url("slow")
    rm = RemoteRewardModel(url, max_retries=0, timeout=0.2, backoff=0.01)
    with pytest.raises(RemoteRewardError, match=rf"{url} failed after 1 attempt"):
        asyncio.run(rm.acall("x", "x", {}))


def test_remote_rm_through_runner_and_boxed(server):
    samples = [Sample("a", "a"), Sample("b", "a")]
    res = score_samples(samples, "remote_rm", rm_options=dict(rm_url=server.url("ok"), **FAST), reward_key="reward")
    assert res.rewards == [1.0, 0.0]
    # boxed_remote_rm sends only the boxed answer
    res = score_samples([Sample("work \\boxed{a}", "a")], "boxed_remote_rm", rm_options=dict(rm_url=server.url("ok"), **FAST))
    assert res.rewards == [1.0]
    # permanent failure under both policies
    opts = dict(rm_url=server.url("down"), max_retries=1, **FAST)
    with pytest.raises(RewardError, match=r"sample 0 \(reward remote_rm\): RemoteRewardError: .*/down failed after 2"):
        score_samples([Sample("a", "a")], "remote_rm", rm_options=opts)
    s = Sample("a", "a")
    res = score_samples([s], "remote_rm", rm_options=opts, on_error="zero")
    assert res.rewards == [0.0] and res.num_errors == 1
    assert "/down failed after 2" in s.metadata["reward_error"]
