"""What rollout hooks receive: `RolloutContext`.

A rollout function (`--rollout-function-path`) is called as `fn(ctx, rollout_id)` and returns a
`RolloutOutput` (or a plain `list[list[Sample]]` of prompt groups). A custom generate function
(`--custom-generate-function-path`) is `async fn(ctx, sample, sampling_params) -> Sample`; it talks to
the engines with `await ctx.engine_generate(input_ids, sampling_params)` (token in, token out).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from relax.wire.auth import auth_headers
from relax.config.validate import load_hook  # noqa: F401  (the hook loader; rollout code imports it from here)
from relax.data.sample import Sample


def call_flexible(fn: Callable, *args: Any) -> Any:
    """Call `fn` with as many leading positional arguments as it takes (hooks may omit `args`)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn(*args)
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return fn(*args)
    n = sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return fn(*args[:n]) if n < len(args) else fn(*args)


@dataclass
class RolloutOutput:
    """One step's prompt groups (each exactly `--n-samples-per-prompt` samples) and rollout metrics."""

    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RolloutContext:
    args: Any  # the Config
    tokenizer: Any
    data_source: Any = None
    rewards: Any = None  # relax.rollout.rewards.RewardRunner
    router_url: Optional[str] = None
    engine_urls: Sequence[str] = ()
    progress: Any = None
    session: Any = None  # the aiohttp session of the running step (set by the rollout function)
    timeout_s: Optional[float] = None  # one engine request; None: --generate-timeout
    retries: int = 2
    max_concurrency: int = 64  # samples in flight at once, over all engines
    group_requests: bool = False  # engines take a prompt group as one request (SGLang's `n` with per-copy seeds)
    batch_parts: int = 1  # group requests of one event-loop turn go as this many batched requests (one per engine)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.timeout_s is None:
            self.timeout_s = float(self.args.generate_timeout)

    async def engine_generate(self, input_ids: Sequence[int], sampling_params: dict, *, rid: Optional[str] = None,
                              extra: Optional[dict] = None):
        """One /generate call through the router: `relax.rollout.generate.EngineReply`. `extra`: more
        request fields, e.g. `relax.rollout.generate.sample_payload_fields(sample)` (multimodal inputs)."""
        from relax.rollout.generate import call_engine

        if self.session is None:
            raise RuntimeError("engine_generate is only available inside a running rollout")
        return await call_engine(self.session, self.router_url, input_ids, sampling_params, rid=rid,
                                 timeout_s=self.timeout_s, retries=self.retries, extra=extra)

    async def abort(self, rids: Sequence[str]) -> None:
        """Abort requests by id at every engine (the router does not know where each one runs)."""
        import asyncio

        import aiohttp

        if not rids or self.session is None:
            return

        async def one(url: str) -> None:
            try:
                async with self.session.post(url + "/abort_request", json={"rid": list(rids)}, headers=auth_headers(),
                                             timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass  # the request finishes on its own; the step waits for it

        await asyncio.gather(*(one(u) for u in (self.engine_urls or [self.router_url])))
