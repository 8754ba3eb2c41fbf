"""Token-in/token-out generation through the router (or one engine).

Prompts are sent as token ids, and the response tokens and their log-probs are taken from the
engine's reply as they are (no re-tokenization), so what is trained is exactly what was generated.

Sampling seeds: every request of `generate_one` carries SGLang's `sampling_params["sampling_seed"]`,
derived from `--rollout-seed`, the rollout step, the prompt group and the sample's place in its group
(`sample_seed`). An engine that honours it (the embedded engine always does; SGLang with deterministic
inference) then samples the same tokens for the same sample whatever the batching, the engine that
serves it or a restart in between, so a resumed run regenerates exactly the rollouts of a straight one.

Failover (--use-fault-tolerance, `set_failover_window`): a request that fails on a server error (HTTP 5xx) or
a broken connection, as requests held by an engine that died or hung do, is sent again, through the router,
for up to the window's seconds without using up its retries: the health monitor takes the failed engine
out of the router within that time (`relax.rollout.engine_pool`), so the request lands on another engine.
The sample is filled only from the answer that succeeds, so it is neither lost nor counted twice.

`call_engine` is the single HTTP call (with timeout and retries) that the default per-sample
generation and custom generate functions (multi-turn, tool calls) share. `generate_one` fills one
sample's response, resuming an aborted partial response when the sample carries one; `generate_group`
fills a fresh prompt group with one request (SGLang's `n`), where the engine supports it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import aiohttp

from relax.wire.auth import auth_headers
from relax.data.sample import STATUS_ABORTED, STATUS_COMPLETED, STATUS_TRUNCATED, Sample

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
# --rollout-seed of this process's run (set by SamplingSettings.from_config); None: no seeds are sent.
_ROLLOUT_SEED: int | None = None
# Place of each sample in its group, by (rollout step, group index): the n-th request of a group gets slot n.
# Requests of a group are issued in group order (asyncio runs the group's tasks in creation order and the
# concurrency semaphore wakes waiters first-in first-out), so the slots follow the group's sample order.
_SLOTS: dict[tuple[int, int], int] = {}
# Seconds a request failing on a server error or a broken connection is sent again without counting as a
# retry (0: failover off); and how many such resends this process made (the rollout reports them per step).
_FAILOVER_S = 0.0
FAILOVER_RESENDS = 0


def _mix64(*values: int) -> int:
    z = 0x2545F4914F6CDD1D
    for v in values:
        z = (z ^ (int(v) & _MASK64)) * 0x9E3779B97F4A7C15 & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z


def sample_seed(rollout_seed: int, rollout_step: int, group_index: int, slot: int) -> int:
    """The sampling seed of one sample: a 31-bit hash of (--rollout-seed, step, group, place in group)."""
    return _mix64(rollout_seed, rollout_step, group_index, slot) & 0x7FFFFFFF


def set_rollout_seed(seed: int | None) -> None:
    global _ROLLOUT_SEED
    _ROLLOUT_SEED = None if seed is None else int(seed)


def set_failover_window(seconds: float) -> None:
    """--use-fault-tolerance: how long failed requests are re-sent while a failed engine leaves the router."""
    global _FAILOVER_S
    _FAILOVER_S = max(0.0, float(seconds))


def _seed_for(sample: Sample) -> int | None:
    if _ROLLOUT_SEED is None:
        return None
    key = (int(sample.rollout_step), int(sample.group_index))
    if len(_SLOTS) > 4096:  # forget old steps
        for k in [k for k in _SLOTS if k[0] < key[0] - 1]:
            del _SLOTS[k]
    slot = _SLOTS.get(key, 0)
    _SLOTS[key] = slot + 1
    return sample_seed(_ROLLOUT_SEED, key[0], key[1], slot)


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    skip_special_tokens: bool = False
    min_new_tokens: int = 0
    max_context_len: int | None = None

    @classmethod
    def from_config(cls, config: Any) -> "SamplingSettings":
        """The `--rollout-*` settings. Evaluation samples with its sets' own settings (`EvalSet.sampling_params`,
        from the `--eval-*` values config validation derived)."""
        if config["rollout_seed"] is not None:
            set_rollout_seed(config["rollout_seed"])
        stop = config["rollout_stop"]
        return cls(temperature=config["rollout_temperature"], top_p=config["rollout_top_p"],
                   top_k=config["rollout_top_k"], max_new_tokens=config["rollout_max_response_len"] or 256,
                   stop=tuple(stop) if stop else None,
                   stop_token_ids=tuple(config["rollout_stop_token_ids"]) if config["rollout_stop_token_ids"] else None,
                   skip_special_tokens=bool(config["rollout_skip_special_tokens"]),
                   max_context_len=config["rollout_max_context_len"])

    def to_sglang(self) -> dict[str, Any]:
        params: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                                  "max_new_tokens": self.max_new_tokens,
                                  "skip_special_tokens": self.skip_special_tokens}
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.min_new_tokens:
            params["min_new_tokens"] = self.min_new_tokens
        return params


# --use-rollout-routing-replay request fields: SGLang's `return_routed_experts`, and the same wish as a custom
# label, because sglang-router 0.3.2 re-serializes /generate bodies through a typed struct that has no
# `return_routed_experts` (dropped, measured) but forwards `custom_labels`; the embedded engine honours both.
ROUTED_EXPERTS_FIELDS = {"return_routed_experts": True, "custom_labels": {"return_routed_experts": "true"}}


class GenerationError(RuntimeError):
    """An engine request failed for good (the run stops; no sample is dropped silently)."""


@dataclass
class EngineReply:
    """One /generate answer: the new tokens exactly as the engine produced them."""

    tokens: list[int]
    logprobs: list[float]
    text: str
    finish: str | None  # "stop", "length", "abort" (SGLang's finish_reason.type)
    weight_version: int = 0
    raw: dict = field(default_factory=dict)

    @property
    def status(self) -> str:
        return {"length": STATUS_TRUNCATED, "abort": STATUS_ABORTED}.get(self.finish or "", STATUS_COMPLETED)


# LoRA adapter-only sync (relax.backends.megatron.lora_sync): the adapter the policy's requests name, as SGLang's
# `lora_path`, once the trainer has loaded it on the engines (the rollout role sets it after such a push); None: the
# engines serve the policy as their weights
_REQUEST_ADAPTER: str | None = None


def set_request_adapter(name: str | None) -> None:
    global _REQUEST_ADAPTER
    _REQUEST_ADAPTER = name


def generate_payload(input_ids: Sequence[int], sampling: dict, *, rid: str | None = None,
                     extra: dict | None = None, policy: bool = False) -> dict[str, Any]:
    """The JSON body of one SGLang /generate request (token ids in, log-probs back). `policy`: a request of the
    policy being trained, which names its LoRA adapter when one is loaded (`set_request_adapter`)."""
    payload: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": sampling, "return_logprob": True}
    if policy and _REQUEST_ADAPTER is not None:
        payload["lora_path"] = _REQUEST_ADAPTER
    if rid is not None:
        payload["rid"] = rid
    if extra:
        payload.update(extra)
    return payload


def sample_payload_fields(sample: Sample) -> dict[str, Any]:
    """Request fields a sample carries besides its tokens: its multimodal inputs (--multimodal-keys)."""
    from relax.rollout.multimodal import SAMPLE_KEY, payload_fields

    return payload_fields((sample.metadata or {}).get(SAMPLE_KEY))


UNAVAILABLE_BUDGET_S = 180.0  # how long "no engine available" (HTTP 503) is waited out before failing


async def post_generate(session: aiohttp.ClientSession, url: str, payload: dict, *, timeout_s: float = 600.0,
                        retries: int = 2, what: str = "request",
                        unavailable_budget_s: float = UNAVAILABLE_BUDGET_S) -> Any:
    """POST {url}/generate with `payload` and return the decoded answer (one reply, or a list for a batch).

    Retries transport errors `retries` times, and waits out HTTP 503 (the router has no healthy engine for
    now, e.g. while its circuit breaker is open or an engine is being replaced) with backoff for up to
    `unavailable_budget_s`; within the failover window (`set_failover_window`) server errors and broken
    connections are sent again without counting as retries; raises GenerationError at the end."""
    global FAILOVER_RESENDS
    last_error = ""
    attempt = failures = 0
    started = time.monotonic()
    while True:
        attempt += 1
        status = None
        try:
            async with session.post(url + "/generate", json=payload, headers=auth_headers(),
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                body = await resp.json(content_type=None)
                if resp.status != 200:
                    status = resp.status
                    last_error = f"HTTP {resp.status}: {str(body)[:300]}"
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=last_error)
            return body
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if not last_error:
                last_error = (f"no answer within {timeout_s:g} s (--generate-timeout)"
                              if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}")
            waited = time.monotonic() - started
            if status == 503 and waited < unavailable_budget_s:
                await asyncio.sleep(min(5.0, 0.2 * 2 ** min(attempt, 5)))
                last_error = ""
                continue
            timed_out = isinstance(exc, asyncio.TimeoutError) and status is None
            if waited < _FAILOVER_S and not timed_out and (status is None or status >= 500):
                FAILOVER_RESENDS += 1
                logger.info("failover: %s via %s failed (%s); sending it again", what, url, last_error)
                await asyncio.sleep(min(2.0, 0.1 * 2 ** min(attempt, 4)))
                last_error = ""
                continue
            failures += 1
            if failures > retries:
                raise GenerationError(f"generation for {what} failed via {url} after {attempt} attempt(s) in "
                                      f"{waited:.0f} s: {last_error}") from None
            await asyncio.sleep(min(2.0, 0.2 * 2 ** failures))
            last_error = ""


def engine_reply(body: dict) -> EngineReply:
    """One /generate answer (SGLang's schema) as an EngineReply."""
    meta = body["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    try:
        version = int(meta.get("weight_version"))
    except (TypeError, ValueError):
        version = 0
    return EngineReply(tokens=[int(p[1]) for p in pairs], logprobs=[float(p[0]) for p in pairs],
                       text=body.get("text", ""), finish=(meta.get("finish_reason") or {}).get("type"),
                       weight_version=version, raw=body)


async def call_engine(session: aiohttp.ClientSession, url: str, input_ids: Sequence[int], sampling: dict, *,
                      rid: str | None = None, timeout_s: float = 600.0, retries: int = 2,
                      what: str = "request", extra: dict | None = None,
                      unavailable_budget_s: float = UNAVAILABLE_BUDGET_S) -> EngineReply:
    """One prompt's /generate call (see `post_generate` for retries and waiting out HTTP 503).
    `extra`: more request fields (e.g. `image_data` of a multimodal sample)."""
    payload = generate_payload(input_ids, sampling, rid=rid, extra=extra, policy=True)
    body = await post_generate(session, url, payload, timeout_s=timeout_s, retries=retries, what=what,
                               unavailable_budget_s=unavailable_budget_s)
    return engine_reply(body)


def sample_rid(sample: Sample) -> str:
    """The engine request id of a sample (used to abort it)."""
    return f"relax-{sample.rollout_step}-{sample.group_index}-{sample.index}-{id(sample)}"


async def generate_one(session: aiohttp.ClientSession, url: str, sample: Sample, sampling: dict, *,
                       timeout_s: float = 600.0, retries: int = 2, mask_offpolicy: bool = False,
                       max_context_len: int | None = None, return_routed_experts: bool = False) -> Sample:
    """Fill (or, for an aborted partial response, continue) one sample's response.

    A resumed sample sends prompt + its response so far and gets at most the remaining new tokens; with
    `mask_offpolicy` the tokens generated before the resume get loss_mask 0. `max_context_len` caps
    prompt + response (the request asks for fewer new tokens; a prompt that already fills it is truncated
    with no response). `return_routed_experts` (--use-rollout-routing-replay): the request asks for SGLang's
    `return_routed_experts` and the sample keeps them (`Sample.rollout_routed_experts`, merged with the routes
    of an earlier partial response, see `relax.data.routes`).
    """
    done = list(sample.response_tokens) if sample.status == STATUS_ABORTED else []
    params = dict(sampling)
    if "sampling_seed" not in params:
        seed = _seed_for(sample)
        if seed is not None:
            params["sampling_seed"] = seed
    if max_context_len:
        room = max_context_len - len(sample.prompt_tokens) - len(done)
        params["max_new_tokens"] = min(int(params["max_new_tokens"]), room + len(done))
        if room <= 0:
            if not done:
                sample.response_tokens, sample.response_logprobs, sample.loss_mask = [], [], []
                sample.rollout_routed_experts = None
            sample.status = STATUS_TRUNCATED
            return sample
    if done:
        params["max_new_tokens"] = max(0, int(params["max_new_tokens"]) - len(done))
        if params["max_new_tokens"] == 0:
            sample.status = STATUS_TRUNCATED
            return sample
        if mask_offpolicy:
            sample.loss_mask = [0] * len(done)
        sample.metadata["resumed_tokens"] = sample.metadata.get("resumed_tokens", 0) + len(done)
    else:
        sample.response_tokens, sample.response_logprobs, sample.loss_mask = [], [], []
        sample.response_text = ""
        sample.rollout_routed_experts = None
    sample.metadata["rid"] = rid = sample_rid(sample)
    extra = sample_payload_fields(sample)
    if return_routed_experts:
        extra = {**(extra or {}), **ROUTED_EXPERTS_FIELDS}
    reply = await call_engine(session, url, sample.prompt_tokens + done, params, rid=rid, timeout_s=timeout_s,
                              retries=retries, what=sample.describe(),
                              extra=extra)
    if done:  # the reply continues the earlier partial response
        mask = list(sample.loss_mask) if len(sample.loss_mask) == len(done) else [1] * len(done)
        sample.response_tokens = done + reply.tokens
        sample.response_logprobs = list(sample.response_logprobs) + reply.logprobs
        sample.loss_mask = mask + [1] * len(reply.tokens)
        sample.response_text = sample.response_text + reply.text
        sample.status = reply.status
        sample.weight_version = reply.weight_version
    else:
        _fill_fresh(sample, reply)
    if return_routed_experts:
        _keep_routes(sample, reply, len(sample.prompt_tokens) + len(done))
    return sample


def group_request_ok(samples: Sequence[Sample], sampling: dict) -> bool:
    """Whether a prompt group can be generated as one /generate request with SGLang's `n`: fresh samples of
    one prompt (no partial response to resume), no per-sample request fields (multimodal inputs), and no
    `sampling_seed` forced by the caller. Otherwise each sample is its own request (`generate_one`)."""
    first = samples[0]
    return (len(samples) > 1 and "sampling_seed" not in sampling and "n" not in sampling
            and all(s.status != STATUS_ABORTED and not s.response_tokens and s.prompt_tokens == first.prompt_tokens
                    and not sample_payload_fields(s) for s in samples))


# Custom label of a batched group request that carries each prompt's `sampling_seed` (comma-separated, prompt
# order): SGLang takes a list of `sampling_params` for that, which sglang-router 0.3.2 refuses (its typed
# /generate body has one sampling_params object; measured: HTTP 422), while it forwards `custom_labels`. The
# embedded engine honours the label (relax.backends.embedded.server.build_requests).
SEEDS_LABEL = "sampling_seeds"
# Group requests issued in the same turn of the event loop with the same settings wait here to go as one batched
# /generate request: key -> [(samples, seed, future)]; see `generate_group`.
_BATCHES: dict[tuple, list[tuple[Sequence[Sample], int | None, asyncio.Future]]] = {}


async def generate_group(session: aiohttp.ClientSession, url: str, samples: Sequence[Sample], sampling: dict, *,
                         timeout_s: float = 600.0, retries: int = 2,
                         max_context_len: int | None = None, batch_parts: int = 1) -> list[Sample]:
    """Fill a prompt group's responses with one request (`group_request_ok` must hold): the prompt once, with
    SGLang's `n` = group size. One request instead of n saves the per-request HTTP, router and admission cost
    (measured on 2 cores, 512 answers of 8 tokens through sglang-router: 2.5-5 s as single requests, 0.5-1 s
    as groups of 16), and the engine prefills the prompt once for the whole group.

    Batching: the groups whose requests are issued in the same turn of the event loop (a step's groups, launched
    together) with the same sampling settings go as one batched request (SGLang's list of `input_ids`, `n` each;
    answers prompt-major); each prompt's seed travels in the `sampling_seeds` custom label (`SEEDS_LABEL`).
    Measured on 2 cores: 32 groups of 16 to the embedded engine take ~0.2 s as one request, ~0.4 s as 32.
    `batch_parts` (the number of engines behind the router): the gathered groups go as that many requests of
    about equal size, so that the router spreads them over every engine instead of giving one engine the step.

    Seeds: a group's `sampling_seed` is the seed of its first sample (`sample_seed`, slot 0) and the engine gives
    copy j the seed + j (the embedded engine's `n` semantics, see its server's `build_requests`), so each answer
    is fixed by (--rollout-seed, step, group, place in group) whatever the batching. Request ids: copy j of
    request id R is `R_j` (SGLang's convention for batches), `R_i_j` for prompt i of a batched request R, which
    is what an abort names."""
    first = samples[0]
    params = dict(sampling, n=len(samples))
    if max_context_len:
        room = max_context_len - len(first.prompt_tokens)
        if room <= 0:
            for s in samples:
                s.response_tokens, s.response_logprobs, s.loss_mask = [], [], []
                s.rollout_routed_experts = None
                s.status = STATUS_TRUNCATED
            return list(samples)
        params["max_new_tokens"] = min(int(params["max_new_tokens"]), room)
    seed = None
    if _ROLLOUT_SEED is not None:
        seed = sample_seed(_ROLLOUT_SEED, int(first.rollout_step), int(first.group_index), 0)
    loop = asyncio.get_running_loop()
    parts = max(1, int(batch_parts))
    key = (id(loop), id(session), url, repr(sorted(params.items())), float(timeout_s), int(retries), parts)
    waiting = _BATCHES.get(key)
    if waiting is None:
        waiting = _BATCHES[key] = []
        loop.call_soon(_send_batch, key, session, url, params, timeout_s, retries, parts)
    done = loop.create_future()
    waiting.append((samples, seed, done))
    answers = await done
    for s, answer in zip(samples, answers):
        _fill_fresh(s, engine_reply(answer))
    return list(samples)


def _send_batch(key: tuple, session: aiohttp.ClientSession, url: str, params: dict, timeout_s: float,
                retries: int, parts: int) -> None:
    """Send the group requests gathered under `key` (see `generate_group`) as `parts` requests (fewer when there
    are fewer groups) of consecutive groups; each caller gets its group's answers, or the error."""
    entries = _BATCHES.pop(key)
    parts = min(parts, len(entries))
    size, extra = divmod(len(entries), parts)
    start = 0
    for part in range(parts):
        end = start + size + (1 if part < extra else 0)
        task = asyncio.ensure_future(_post_batch(entries[start:end], session, url, params, timeout_s, retries))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)  # seen by the callers
        start = end


async def _post_batch(entries: list, session: aiohttp.ClientSession, url: str, params: dict, timeout_s: float,
                      retries: int) -> None:
    n = int(params["n"])
    firsts = [samples[0] for samples, _, _ in entries]
    rid = f"relax-{firsts[0].rollout_step}-g{firsts[0].group_index}-{id(firsts[0])}"
    seeds = [seed for _, seed, _ in entries]
    if len(entries) == 1:
        payload = generate_payload(firsts[0].prompt_tokens, dict(params, **({} if seeds[0] is None else
                                                                            {"sampling_seed": seeds[0]})), rid=rid,
                                   policy=True)
        rids = [[f"{rid}_{j}" for j in range(n)]]
    else:
        payload = generate_payload([f.prompt_tokens for f in firsts], dict(params), rid=rid, policy=True)
        if seeds[0] is not None:
            payload["custom_labels"] = {SEEDS_LABEL: ",".join(str(x) for x in seeds)}
        rids = [[f"{rid}_{i}_{j}" for j in range(n)] for i in range(len(entries))]
    for (samples, _, _), names in zip(entries, rids):
        for s, name in zip(samples, names):
            s.metadata["rid"] = name
    what = (f"group {firsts[0].group_index} ({n} samples)" if len(entries) == 1 else
            f"groups {', '.join(str(f.group_index) for f in firsts)} ({n} samples each)")
    try:
        body = await post_generate(session, url, payload, timeout_s=timeout_s, retries=retries, what=what)
        want = n * len(entries)
        if not isinstance(body, list) or len(body) != want:
            raise GenerationError(f"{what}: asked {url} for {want} answers (n={n}) and got "
                                  f"{len(body) if isinstance(body, list) else 'one'}; the engine must support "
                                  "SGLang's `n` (parallel sampling) and batched input")
    except asyncio.CancelledError:
        for _, _, done in entries:
            done.cancel()
        raise
    except BaseException as exc:
        for _, _, done in entries:
            if not done.done():
                done.set_exception(exc)
        raise
    for i, (_, _, done) in enumerate(entries):
        if not done.done():
            done.set_result(body[i * n:(i + 1) * n])


def _fill_fresh(sample: Sample, reply: EngineReply) -> None:
    """A sample's response is exactly the reply (no earlier partial response)."""
    sample.response_tokens = list(reply.tokens)
    sample.response_logprobs = list(reply.logprobs)
    sample.loss_mask = [1] * len(reply.tokens)
    sample.response_text = reply.text
    sample.rollout_routed_experts = None
    sample.status = reply.status
    sample.weight_version = reply.weight_version


def _keep_routes(sample: Sample, reply: EngineReply, context_len: int) -> None:
    """Store the reply's routed experts (context + new tokens - 1 rows) on the sample."""
    from relax.data.routes import merge_routes, routes_from_reply

    data = (reply.raw.get("meta_info") or {}).get("routed_experts")
    rows = context_len + len(reply.tokens) - 1
    if data is None:
        raise GenerationError(f"--use-rollout-routing-replay: the engine sent no routed_experts for sample "
                              f"{sample.index} (group {sample.group_index}); SGLang needs "
                              "--enable-return-routed-experts, and a router between must forward the request")
    if rows <= 0:
        return
    sample.rollout_routed_experts = merge_routes(sample.rollout_routed_experts, routes_from_reply(data, rows))


async def generate_samples(router_url: str, samples: Sequence[Sample], sampling: SamplingSettings, *,
                           max_concurrency: int = 64, timeout_s: float = 600.0, retries: int = 2,
                           progress: Any = None) -> list[Sample]:
    """Fill each sample's response from the engines; every HTTP call has a timeout."""
    params = sampling.to_sglang()
    limit = asyncio.Semaphore(max_concurrency)

    async with aiohttp.ClientSession() as session:
        async def run(sample: Sample) -> Sample:
            async with limit:
                done = await generate_one(session, router_url, sample, params, timeout_s=timeout_s, retries=retries)
            if progress is not None:
                progress.update(1)
            return done

        return list(await asyncio.gather(*(run(s) for s in samples)))
