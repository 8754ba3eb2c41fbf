"""Relax's router (--use-slime-router) without Ray: routing, the worker failure threshold, deadlines,
the middleware chain and its loading, the radix tree and the token cache, the process wrapper."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import pytest
import requests
from aiohttp import web
from transformers import AutoTokenizer

from conftest import relax_cli, shared_tiny_model

from relax.wire.auth import ENGINE_API_KEY_ENV, auth_headers, ensure_engine_api_key
from relax.wire.net import find_free_port
from relax.backends.relax_router.middleware import ProxyRequest, ProxyResponse
from relax.config.middleware_paths import MiddlewareError, load_middleware_factory
from relax.backends.relax_router.process import RelaxRouterProcess
from relax.backends.relax_router.radix import RadixTree
from relax.backends.relax_router.radix_middleware import RadixTreeMiddleware, TokenCache, TokenRecord
from relax.backends.relax_router.server import RelaxRouter, RouterSettings, build_app
from relax.config import parse_config
from relax.config.errors import ConfigError
from relax.config.support import unsupported_flags

ensure_engine_api_key()


# ---------------------------------------------------------------- a fake engine (SGLang's /generate schema)

class FakeEngine:
    def __init__(self, name: str, delay_s: float = 0.0, health_status: int = 200):
        self.name, self.delay_s, self.health_status = name, delay_s, health_status
        self.requests: list[dict] = []
        self.auth: list[str | None] = []
        self.runner = None
        self.url = ""

    async def start(self):
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/flush_cache", self.flush)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = find_free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self):
        await self.runner.cleanup()

    async def health(self, _):
        return web.json_response({}, status=self.health_status)

    async def flush(self, request):
        self.auth.append(request.headers.get("Authorization"))
        return web.json_response({"success": True})

    async def generate(self, request):
        body = await request.json()
        self.requests.append(body)
        self.auth.append(request.headers.get("Authorization"))
        await asyncio.sleep(self.delay_s)
        out = [1000 + len(self.requests), 7]  # tokens a re-tokenisation of the text would not give back
        return web.json_response({"text": f"<{self.name}>", "output_ids": out,
                                  "meta_info": {"weight_version": 3, "finish_reason": {"type": "length"},
                                                "output_token_logprobs": [[-0.5, t, None] for t in out]}})


async def start_router(settings: RouterSettings):
    router = RelaxRouter(settings)
    await router.open()
    runner = web.AppRunner(build_app(router))
    await runner.setup()
    port = find_free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return router, runner, f"http://127.0.0.1:{port}"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def post(session, url, body, key=True):
    async with session.post(url, json=body, headers=auth_headers() if key else {}) as r:
        return r.status, await r.json(content_type=None)


# ---------------------------------------------------------------- radix tree and token cache

def test_radix_tree_longest_prefix_split_and_eviction():
    t = RadixTree(max_entries=3)
    t.insert("hello world", 1)
    t.insert("hello", 2)          # splits the edge
    t.insert("help", 3)           # splits again
    assert t.longest_prefix("hello world!") == (11, 1)
    assert t.longest_prefix("hello there") == (5, 2)
    assert t.longest_prefix("helping") == (4, 3)
    assert t.longest_prefix("hel") == (0, None) and t.get("hell") is None and t.get("help") == 3
    assert t.insert("hello", 20) == 2
    t.longest_prefix("help")      # used: "hello world" is now the least recently used
    t.insert("x", 4)
    assert len(t) == 3 and t.evictions == 1 and t.get("hello world") is None and t.get("hello") == 20
    for key in ("hello", "help", "x"):
        t._drop(t._lru.pop(id(_node(t, key))))
    assert t.root.children == {}   # every node pruned


def _node(tree, key):
    node, i = tree.root, 0
    while i < len(key):
        node = node.children[key[i]]
        i += len(node.edge)
    return node


def test_token_cache_keeps_engine_tokens_and_tokenises_only_the_rest():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    cache = TokenCache(Tok(), max_tokens=12)
    rec, cached = cache.lookup("ab")
    assert rec.tokens.tolist() == [97, 98] and rec.loss_mask.tolist() == [0, 0] and cached == 0
    cache.insert("ab" + "XY", TokenRecord.of((97, 98, 500), (0.0, 0.0, -1.0), (0, 0, 1), 2))  # 1 token for "XY"
    rec, cached = cache.lookup("abXY!")
    assert rec.tokens.tolist() == [97, 98, 500, 33] and rec.loss_mask.tolist() == [0, 0, 1, 0] and cached == 3
    assert rec.logprobs.tolist() == [0.0, 0.0, -1.0, 0.0] and rec.weight_version == 2
    cache.insert("abXY", TokenRecord.of((97, 98, 88, 89), (0.0,) * 4, (0, 0, 1, 1)))
    assert cache.stats()["conflicts"] == 1 and cache.stats()["tokens"] == 4
    # the token budget: 4 + 5 fit, a third entry of 5 drops the least recently used one
    cache.insert("q", TokenRecord.of(range(5), [0.0] * 5, [1] * 5))
    cache.lookup("abXY")
    cache.insert("r", TokenRecord.of(range(5), [0.0] * 5, [1] * 5))
    assert cache.stats()["evictions"] == 1 and cache.tree.get("q") is None and cache.tree.get("abXY") is not None
    assert cache.stats()["tokens"] == 9


# ---------------------------------------------------------------- routing

def test_routing_spreads_load_keeps_text_prefixes_and_presents_the_key():
    async def go():
        engines = [await FakeEngine("a").start(), await FakeEngine("b").start()]
        router, runner, url = await start_router(RouterSettings(request_timeout_s=10))
        try:
            async with aiohttp.ClientSession() as s:
                assert (await post(s, url + "/workers", {"url": engines[0].url}, key=False))[0] == 401
                for e in engines:
                    assert (await post(s, url + "/workers", {"url": e.url}))[0] == 202
                async with s.get(url + "/workers", headers=auth_headers()) as r:
                    assert sorted(w["url"] for w in (await r.json())["workers"]) == sorted(e.url for e in engines)
                for i in range(6):  # generation is open, like the engines' (relax.wire.auth)
                    status, body = await post(s, url + "/generate", {"input_ids": [i, 1, 2]}, key=False)
                    assert status == 200 and body["output_ids"][1] == 7
                assert [len(e.requests) for e in engines] == [3, 3]
                # a text sharing a long prefix goes where that prefix went, while loads stay close
                first = None
                for turn in range(4):
                    text = "a long shared conversation prefix" + " turn" * turn
                    status, body = await post(s, url + "/generate", {"text": text})
                    first = first or body["text"]
                    assert body["text"] == first
                assert all(a == f"Bearer {os.environ[ENGINE_API_KEY_ENV]}" for e in engines for a in e.auth)
                # the router lends its key to no one: a control endpoint without it is refused, not forwarded
                n = len(engines[0].auth) + len(engines[1].auth)
                assert (await post(s, url + "/update_weights_from_disk", {"model_path": "/x"}, key=False))[0] == 401
                assert (await post(s, url + "/flush_cache", {}, key=False))[0] == 401
                assert len(engines[0].auth) + len(engines[1].auth) == n
                status, body = await post(s, url + "/flush_cache", {})  # to every engine
                assert status == 200 and sorted(body["workers"]) == sorted(e.url for e in engines)
        finally:
            await runner.cleanup()
            await router.close()
            for e in engines:
                await e.stop()
    run(go())


def test_failure_threshold_removes_a_failing_worker():
    async def go():
        good, sick = await FakeEngine("good").start(), await FakeEngine("sick", health_status=500).start()
        dead = f"http://127.0.0.1:{find_free_port()}"  # nothing listens
        router, runner, url = await start_router(RouterSettings(request_timeout_s=5, failure_threshold=2,
                                                                health_interval_s=0.1))
        try:
            async with aiohttp.ClientSession() as s:
                for u in (good.url, sick.url, dead):
                    await post(s, url + "/workers", {"url": u})
                # sick: 1 failed health check at join, 1 more in the loop -> removed; dead: refused connections
                for _ in range(6):
                    status, body = await post(s, url + "/generate", {"input_ids": [1, 2]})
                    assert status == 200 and body["text"] == "<good>"  # never an error for the client
                await asyncio.sleep(0.5)
                async with s.get(url + "/workers", headers=auth_headers()) as r:
                    state = await r.json()
                assert [w["url"] for w in state["workers"]] == [good.url]
                evicted = {e["url"]: e["reason"] for e in state["evicted"]}
                assert set(evicted) == {sick.url, dead} and "2 consecutive failures" in evicted[sick.url]
                router.workers.clear()
                status, body = await post(s, url + "/generate", {"input_ids": [1]})
                assert status == 503  # no engine: clients wait this out (relax.rollout.generate.post_generate)
        finally:
            await runner.cleanup()
            await router.close()
            await good.stop()
            await sick.stop()
    run(go())


def test_request_deadline_answers_504_and_counts_a_failure():
    async def go():
        slow = await FakeEngine("slow", delay_s=2.0).start()
        router, runner, url = await start_router(RouterSettings(request_timeout_s=0.3, failure_threshold=2,
                                                                health_interval_s=60))
        try:
            async with aiohttp.ClientSession() as s:
                await post(s, url + "/workers", {"url": slow.url})
                t0 = time.monotonic()
                status, body = await post(s, url + "/generate", {"input_ids": [1]})
                assert status == 504 and "--slime-router-timeout" in body["error"]["message"]
                assert time.monotonic() - t0 < 1.5
                assert router.workers[slow.url].failures == 1
                await post(s, url + "/generate", {"input_ids": [1]})
                assert slow.url in router.evicted  # the second consecutive failure
        finally:
            await runner.cleanup()
            await router.close()
            await slow.stop()
    run(go())


# ---------------------------------------------------------------- middlewares

class Tag:
    """A test middleware: tags the request on the way in and the answer on the way out."""

    def __init__(self, router, name="tag"):
        self.name = name

    async def handle(self, request, call_next):
        if isinstance(request.body, dict):
            request.body.setdefault("tags", []).append(self.name)
        resp = await call_next(request)
        if isinstance(resp.body, dict):
            resp.body.setdefault("out", []).append(self.name)
        return resp


def second_tag(router):
    return Tag(router, "second")


class ShortCircuit:
    def __init__(self, router):
        pass

    async def handle(self, request, call_next):
        return ProxyResponse(200, {"answered_by": "middleware"})


NOT_A_MIDDLEWARE = 3


def test_middleware_chain_runs_in_order():
    async def go():
        engine = await FakeEngine("a").start()
        router, runner, url = await start_router(RouterSettings(
            request_timeout_s=5, middleware_paths=("test_relax_router.Tag", "test_relax_router.second_tag")))
        try:
            async with aiohttp.ClientSession() as s:
                await post(s, url + "/workers", {"url": engine.url})
                status, body = await post(s, url + "/generate", {"input_ids": [1]})
                assert engine.requests[-1]["tags"] == ["tag", "second"] and body["out"] == ["second", "tag"]
        finally:
            await runner.cleanup()
            await router.close()
            await engine.stop()
        router = RelaxRouter(RouterSettings(middleware_paths=("test_relax_router.ShortCircuit",)))
        assert (await router.handle(ProxyRequest("POST", "/generate", {}))).body == {"answered_by": "middleware"}
    run(go())


def test_bad_middleware_paths_fail_naming_the_flag(tiny_model, prompt_file, tmp_path):
    for path, words in (("nodots", "not a dotted path"), ("no_such_module.Mw", "cannot import module"),
                        ("test_relax_router.Missing", "has no attribute"),
                        ("test_relax_router.NOT_A_MIDDLEWARE", "not a middleware")):
        with pytest.raises(MiddlewareError, match="--slime-router-middleware-paths") as err:
            load_middleware_factory(path)
        assert words in str(err.value)
    base = ["--hf-checkpoint", tiny_model, "--prompt-data", prompt_file, "--rollout-batch-size", "2",
            "--num-rollout", "1", "--output-dir", str(tmp_path)]
    with pytest.raises(ConfigError, match="--slime-router-middleware-paths.*no_such_module"):
        parse_config(base + ["--use-slime-router", "--slime-router-middleware-paths", "no_such_module.Mw"])
    # the command line stops there, before Ray starts
    t0 = time.monotonic()
    proc = relax_cli(*base, "--use-slime-router", "--slime-router-middleware-paths", "no_such_module.Mw")
    assert proc.returncode == 2 and "--slime-router-middleware-paths: cannot import module" in proc.stderr
    assert "Ray" not in proc.stderr + proc.stdout and time.monotonic() - t0 < 60
    with pytest.raises(ConfigError, match="--sglang-router-policy"):
        parse_config(base + ["--use-slime-router", "--sglang-router-policy", "cache_aware"])
    with pytest.raises(ConfigError, match="add --use-slime-router"):
        parse_config(base + ["--slime-router-timeout", "5"])
    parse_config(base + ["--slime-router-health-check-failure-threshold", "3"])  # the default: a saved config's
    with pytest.raises(ConfigError, match="--slime-router-health-check-failure-threshold must be >= 1"):
        parse_config(base + ["--use-slime-router", "--slime-router-health-check-failure-threshold", "0"])
    cfg = parse_config(base + ["--use-slime-router", "--slime-router-timeout", "30", "--slime-router-max-connections",
                               "8", "--slime-router-middleware-paths",
                               "relax.backends.relax_router.radix_middleware.RadixTreeMiddleware"])
    assert unsupported_flags(cfg) == []


def test_radix_middleware_sends_cached_tokens_and_retrieves_them():
    tok = AutoTokenizer.from_pretrained(str(shared_tiny_model()))

    async def go():
        engine = await FakeEngine("e").start()
        router, runner, url = await start_router(RouterSettings(
            request_timeout_s=5, tokenizer=str(shared_tiny_model()),
            middleware_paths=("relax.backends.relax_router.radix_middleware.RadixTreeMiddleware",)))
        assert isinstance(router.chain[0], RadixTreeMiddleware)
        try:
            async with aiohttp.ClientSession() as s:
                await post(s, url + "/workers", {"url": engine.url})
                prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                _, first = await post(s, url + "/generate", {"text": prompt, "sampling_params": {}}, key=False)
                sent = engine.requests[-1]
                assert "text" not in sent and sent["input_ids"] == tok.encode(prompt, add_special_tokens=False)
                assert sent["return_logprob"] is True and first["meta_info"]["cached_prefix_tokens"] == 0
                convo = prompt + first["text"] + "\n<|im_start|>tool\n3<|im_end|>\n"
                _, second = await post(s, url + "/generate", {"text": convo}, key=False)
                tool = tok.encode("\n<|im_start|>tool\n3<|im_end|>\n", add_special_tokens=False)
                p = tok.encode(prompt, add_special_tokens=False)
                assert engine.requests[-1]["input_ids"] == p + first["output_ids"] + tool  # not tok(convo)
                assert second["meta_info"]["cached_prefix_tokens"] == len(p) + 2
                full = convo + second["text"]
                assert (await post(s, url + "/retrieve_from_text", {"text": full}, key=False))[0] == 401
                status, got = await post(s, url + "/retrieve_from_text", {"text": full})
                assert got["tokens"] == p + first["output_ids"] + tool + second["output_ids"]
                assert got["loss_mask"] == [0] * len(p) + [1, 1] + [0] * len(tool) + [1, 1]
                assert got["logprobs"][len(p):len(p) + 2] == [-0.5, -0.5] and got["weight_version"] == 3
                assert got["tokens"] != tok.encode(full, add_special_tokens=False)  # what re-tokenising gives
                async with s.get(url + "/radix_cache/stats", headers=auth_headers()) as r:
                    assert (await r.json())["inserts"] == 2
        finally:
            await runner.cleanup()
            await router.close()
            await engine.stop()
    run(go())


# ---------------------------------------------------------------- the process

def test_router_process_membership_and_dies_with_its_parent(tmp_path):
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(FakeEngine("p").start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    router = RelaxRouterProcess(request_timeout_s=5, health_interval_s=0.2, log_path=str(tmp_path / "r.log"),
                                worker_urls=[engine.url])
    try:
        router.start()
        assert router.worker_urls() == [engine.url]
        router.add_worker(engine.url)  # joining twice changes nothing
        assert router.worker_urls() == [engine.url]
        r = requests.post(router.url + "/generate", json={"input_ids": [1]}, timeout=10)
        assert r.status_code == 200 and r.json()["text"] == "<p>"
        router.remove_worker(engine.url)
        assert router.list_workers() == []
        assert requests.post(router.url + "/workers", json={"url": engine.url}, timeout=5).status_code == 401
    finally:
        router.stop()
        loop.call_soon_threadsafe(loop.stop)
    # a parent killed without stopping its router takes the router with it
    script = ("import sys, time; from relax.backends.relax_router.process import RelaxRouterProcess; "
              "r = RelaxRouterProcess(request_timeout_s=5).start(); print(r.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            if open(f"/proc/{child}/stat").read().split()[2] == "Z":
                break
            time.sleep(0.2)
        else:
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the router outlived its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
