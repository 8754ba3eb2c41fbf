"""The rollout's failover window (--use-fault-tolerance, relax.rollout.generate.set_failover_window): requests that
fail on a server error or a broken connection, as those of an engine that died do behind a router, are sent again
without using up their retries; without the window they fail as before; a client-side error is never resent."""

import asyncio

import aiohttp
import pytest
from aiohttp import web

from relax.rollout import generate as generation

REPLY = {"text": "x", "meta_info": {"output_token_logprobs": [[-0.5, 7, None]], "finish_reason": {"type": "stop"},
                                    "weight_version": "3"}}


async def serve(statuses):
    """A /generate that answers the given statuses in turn (then 200 with REPLY); returns (url, calls, stop)."""
    calls = []

    async def generate(request):
        calls.append(await request.json())
        status = statuses[len(calls) - 1] if len(calls) <= len(statuses) else 200
        return web.json_response(REPLY if status == 200 else {"error": "engine gone"}, status=status)

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}", calls, runner.cleanup


async def call(url, retries=0):
    async with aiohttp.ClientSession() as session:
        return await generation.call_engine(session, url, [1, 2], {"max_new_tokens": 1}, retries=retries,
                                            timeout_s=10)


@pytest.fixture
def window():
    yield generation.set_failover_window
    generation.set_failover_window(0)


def test_server_errors_are_resent_within_the_window(window):
    async def main():
        url, calls, stop = await serve([502, 500, 502])
        try:
            window(30)
            before = generation.FAILOVER_RESENDS
            reply = await call(url, retries=0)
            assert reply.tokens == [7] and reply.weight_version == 3
            assert len(calls) == 4 and generation.FAILOVER_RESENDS - before == 3
            assert all(c == calls[0] for c in calls)  # the same request each time
        finally:
            await stop()
        url, calls, stop = await serve([502])
        try:
            window(0)  # fault tolerance off: a server error uses up the retries as before
            with pytest.raises(generation.GenerationError, match="HTTP 502"):
                await call(url, retries=0)
            assert len(calls) == 1
        finally:
            await stop()

    asyncio.run(main())


def test_client_errors_and_a_closed_window_are_not_resent(window):
    async def main():
        url, calls, stop = await serve([400, 400])
        try:
            window(30)
            with pytest.raises(generation.GenerationError, match="HTTP 400"):
                await call(url, retries=0)
            assert len(calls) == 1
        finally:
            await stop()
        window(0.0)
        with pytest.raises(generation.GenerationError, match="ClientConnectorError|Cannot connect"):
            await call("http://127.0.0.1:9", retries=0)  # nothing listens: one attempt, no window

    asyncio.run(main())


def test_fault_tolerance_flag_rules(tiny_model, prompt_file, tmp_path):
    from relax.config import parse_config
    from relax.config.errors import ConfigError

    def config(*extra):
        return parse_config(["--hf-checkpoint", tiny_model, "--prompt-data", prompt_file, "--rollout-batch-size", "2", "--num-rollout", "1",
                             "--output-dir",
                             str(tmp_path / "out"), *extra])

    on = config("--use-fault-tolerance", "--rollout-health-check-interval", "2", "--rollout-health-check-timeout", "4",
                "--rollout-health-check-first-wait", "1")
    assert (on.rollout_health_check_interval, on.rollout_health_check_timeout) == (2.0, 4.0)
    with pytest.raises(ConfigError, match="add --use-fault-tolerance"):
        config("--rollout-health-check-interval", "2")
    with pytest.raises(ConfigError, match="--rollout-health-check-timeout must be > 0"):
        config("--use-fault-tolerance", "--rollout-health-check-timeout", "0")
    with pytest.raises(ConfigError, match="--rollout-external"):
        config("--use-fault-tolerance", "--rollout-external", "--rollout-external-engine-addrs", "127.0.0.1:1")
