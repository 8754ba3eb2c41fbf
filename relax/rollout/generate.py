"""The default rollout function: prompts -> engines (through the router) -> scored samples.

Token in, token out: prompts are sent as token ids, and the response tokens and their log-probs are
taken from the engine's reply as they are (no re-tokenization), so what is trained is exactly what
was generated.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import aiohttp

from relax.data.sample import STATUS_ABORTED, STATUS_COMPLETED, STATUS_TRUNCATED, Sample

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    skip_special_tokens: bool = False

    @classmethod
    def from_config(cls, config: Any, prefix: str = "rollout") -> "SamplingSettings":
        stop = config[f"{prefix}_stop"] if f"{prefix}_stop" in config else config.rollout_stop
        return cls(temperature=config[f"{prefix}_temperature"], top_p=config[f"{prefix}_top_p"],
                   top_k=config[f"{prefix}_top_k"], max_new_tokens=config[f"{prefix}_max_response_len"] or 256,
                   stop=tuple(stop) if stop else None,
                   stop_token_ids=tuple(config.rollout_stop_token_ids) if config.rollout_stop_token_ids else None,
                   skip_special_tokens=bool(config.rollout_skip_special_tokens))

    def to_sglang(self) -> dict[str, Any]:
        params: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                                  "max_new_tokens": self.max_new_tokens,
                                  "skip_special_tokens": self.skip_special_tokens}
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


class GenerationError(RuntimeError):
    """An engine request failed for good (the run stops; no sample is dropped silently)."""


async def _generate_one(session: aiohttp.ClientSession, url: str, sample: Sample, sampling: dict, timeout_s: float,
                        retries: int) -> Sample:
    payload = {"input_ids": sample.prompt_tokens, "sampling_params": sampling, "return_logprob": True}
    last_error = ""
    for attempt in range(retries + 1):
        try:
            async with session.post(url + "/generate", json=payload,
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                body = await resp.json(content_type=None)
                if resp.status != 200:
                    last_error = f"HTTP {resp.status}: {str(body)[:300]}"
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=last_error)
            break
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            last_error = last_error or f"{type(exc).__name__}: {exc}"
            if attempt == retries:
                raise GenerationError(f"generation for sample {sample.index} failed via {url} after "
                                      f"{retries + 1} attempt(s): {last_error}") from None
            await asyncio.sleep(min(2.0, 0.2 * 2 ** attempt))
            last_error = ""
    meta = body["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    sample.response_tokens = [int(p[1]) for p in pairs]
    sample.response_logprobs = [float(p[0]) for p in pairs]
    sample.loss_mask = [1] * len(sample.response_tokens)
    sample.response_text = body.get("text", "")
    finish = (meta.get("finish_reason") or {}).get("type")
    sample.status = {"length": STATUS_TRUNCATED, "abort": STATUS_ABORTED}.get(finish, STATUS_COMPLETED)
    version = meta.get("weight_version")
    try:
        sample.weight_version = int(version)
    except (TypeError, ValueError):
        sample.weight_version = 0
    return sample


async def generate_samples(router_url: str, samples: Sequence[Sample], sampling: SamplingSettings, *,
                           max_concurrency: int = 64, timeout_s: float = 600.0, retries: int = 2,
                           progress: Any = None) -> list[Sample]:
    """Fill each sample's response from the engines; every HTTP call has a timeout."""
    params = sampling.to_sglang()
    limit = asyncio.Semaphore(max_concurrency)

    async with aiohttp.ClientSession() as session:
        async def run(sample: Sample) -> Sample:
            async with limit:
                done = await _generate_one(session, router_url, sample, params, timeout_s, retries)
            if progress is not None:
                progress.update(1)
            return done

        return list(await asyncio.gather(*(run(s) for s in samples)))
