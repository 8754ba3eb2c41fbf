"""call_engine against a real local HTTP server: "no engine available" (HTTP 503 from the router, e.g. while
its circuit breaker is open) is waited out within a time budget; other errors are retried a few times; the
final error names the URL and the cause."""

import asyncio

import aiohttp
import pytest
from aiohttp import web

from relax.rollout.generate import GenerationError, call_engine

REPLY = {"text": "", "output_ids": [5], "meta_info": {
    "output_token_logprobs": [[-0.5, 5, None]], "finish_reason": {"type": "stop"}, "weight_version": "3",
    "prompt_tokens": 2, "completion_tokens": 1}}


async def _serve(statuses):
    calls = []

    async def generate(request):
        calls.append(await request.json())
        status = statuses[len(calls) - 1] if len(calls) <= len(statuses) else 200
        if status != 200:
            return web.json_response({"error": {"code": "no_available_workers"}}, status=status)
        return web.json_response(REPLY)

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}", calls


def _run(statuses, **kw):
    async def main():
        runner, url, calls = await _serve(statuses)
        try:
            async with aiohttp.ClientSession() as session:
                reply = await call_engine(session, url, [1, 2], {"max_new_tokens": 1}, what="sample 7", **kw)
                return reply, calls
        finally:
            await runner.cleanup()
    return asyncio.run(main())


def test_unavailable_is_waited_out_beyond_the_retry_count():
    reply, calls = _run([503] * 5, retries=1, unavailable_budget_s=60)
    assert len(calls) == 6 and reply is not None


def test_unavailable_fails_after_the_budget_naming_url_and_cause():
    with pytest.raises(GenerationError, match=r"sample 7 failed via http://127\.0\.0\.1:\d+ .*HTTP 503"):
        _run([503] * 1000, retries=1, unavailable_budget_s=1.0)


def test_other_errors_use_the_retry_count():
    with pytest.raises(GenerationError, match=r"after 3 attempt\(s\).*HTTP 500"):
        _run([500] * 10, retries=2)
    reply, calls = _run([500, 500], retries=2)
    assert len(calls) == 3
