"""On-policy distillation with a teacher behind an SGLang-API server (`--use-opd --opd-type sglang --rm-url URL`).

The teacher scores each sample's response without generating: one POST `/generate` per chunk of samples with
    {"input_ids": [prompt + response, ...], "sampling_params": {"max_new_tokens": 0, "temperature": T, ...},
     "return_logprob": true, "logprob_start_len": [len(prompt) - 1, ...]}
and the reply's `meta_info.input_token_logprobs` ([logprob, token id, text] from position `logprob_start_len`
on) gives log pi_teacher(token_i | tokens_<i); the last len(response) entries are the response tokens'.
T is --rollout-temperature (the student's old log-probs use it too); SGLang's /generate applies the sampling
temperature to returned log-probs the way the server does (the embedded engine tempers them; T=1 is untempered).

`SGLangTeacher` has the interface of the Megatron teacher group in relax.core.roles: `compute(step)` (the
teacher stage: reads the step's samples from the data plane, writes their `teacher_logprobs` back) and
`shutdown()`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

__all__ = ["SGLangTeacher", "TeacherError", "normalize_url", "parse_teacher_logprobs", "teacher_logprobs_request"]


class TeacherError(RuntimeError):
    """The teacher server did not give usable log-probs."""


def normalize_url(url: str) -> str:
    """`http://host:port` from `host:port`, `http://host:port/` or `http://host:port/generate`."""
    url = url.strip().rstrip("/")
    url = url.removesuffix("/generate")
    if "://" not in url:
        url = "http://" + url
    return url


def teacher_logprobs_request(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], temperature: float = 1.0) -> dict:
    """The /generate body scoring each (prompt tokens, response tokens) pair (see the module docstring)."""
    for prompt, response in pairs:
        if not prompt or not response:
            raise ValueError("the teacher scores a response after a prompt: both must be non-empty")
    return {
        "input_ids": [list(map(int, p)) + list(map(int, r)) for p, r in pairs],
        "sampling_params": {"max_new_tokens": 0, "temperature": float(temperature), "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": [len(p) - 1 for p, _ in pairs],
    }


def parse_teacher_logprobs(reply: Any, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
    """Per pair, the response tokens' log-probs from a /generate reply (a list for a batch); checks that the
    server scored the tokens we sent."""
    items = reply if isinstance(reply, list) else [reply]
    if len(items) != len(pairs):
        raise TeacherError(f"the teacher answered {len(items)} items for {len(pairs)} samples")
    rows = []
    for item, (_, response) in zip(items, pairs):
        try:
            entries = item["meta_info"]["input_token_logprobs"]
        except (KeyError, TypeError):
            raise TeacherError(f"reply has no meta_info.input_token_logprobs: {str(item)[:200]}") from None
        n = len(response)
        if len(entries) < n:
            raise TeacherError(f"the teacher returned {len(entries)} input log-probs for a {n}-token response")
        tail = entries[-n:]
        if [int(e[1]) for e in tail] != [int(t) for t in response]:
            raise TeacherError("the teacher's input_token_logprobs are for other tokens than the response sent")
        if any(e[0] is None for e in tail):
            raise TeacherError("the teacher returned no log-prob for a response token")
        rows.append([float(e[0]) for e in tail])
    return rows


class SGLangTeacher:
    """Teacher log-probs over HTTP from an SGLang-API server (SGLang, its router, or the embedded engine)."""

    def __init__(self, url: str, data_plane: Any = None, *, temperature: float = 1.0, chunk_size: int = 16,
                 concurrency: int = 4, timeout_s: float = 300.0, retries: int = 3, backoff_s: float = 1.0):
        self.url = normalize_url(url)
        self.data = data_plane
        self.temperature = float(temperature)
        self.chunk_size = max(1, int(chunk_size))
        self.concurrency = max(1, int(concurrency))
        self.timeout_s = float(timeout_s)
        self.retries = max(1, int(retries))
        self.backoff_s = float(backoff_s)
        self._session = requests.Session()

    @classmethod
    def from_config(cls, config: Any, data_plane: Any) -> SGLangTeacher:
        return cls(config.rm_url, data_plane, temperature=config.rollout_temperature)

    def _post(self, body: dict) -> Any:
        last = "no attempt"
        for attempt in range(self.retries):
            try:
                resp = self._session.post(self.url + "/generate", json=body, timeout=self.timeout_s)
                if resp.status_code == 200:
                    return resp.json()
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                if resp.status_code < 500 and resp.status_code not in (408, 429):
                    break  # a bad request: retrying will not help
            except (requests.ConnectionError, requests.Timeout, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if attempt + 1 < self.retries:
                time.sleep(self.backoff_s * 2 ** attempt)
        raise TeacherError(f"teacher {self.url}/generate failed after {attempt + 1} attempt(s): {last}")

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """Teacher log-probs of each (prompt tokens, response tokens) pair's response tokens."""
        chunks = [list(pairs[i:i + self.chunk_size]) for i in range(0, len(pairs), self.chunk_size)]

        def one(chunk):
            return parse_teacher_logprobs(self._post(teacher_logprobs_request(chunk, self.temperature)), chunk)

        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(1, len(chunks)))) as pool:
            parts = list(pool.map(one, chunks))
        return [row for part in parts for row in part]

    def compute(self, step: int) -> float:
        """Stage: the teacher log-probs of step `step`'s samples, written to the data plane as
        `teacher_logprobs`. Returns the seconds it took."""
        t0 = time.perf_counter()
        samples = self.data.get(step, fields=("index", "prompt_tokens", "response_tokens"))
        rows = self.score([(s.prompt_tokens, s.response_tokens) for s in samples])
        self.data.put_fields(step, [s.index for s in samples], teacher_logprobs=rows)
        return time.perf_counter() - t0

    def shutdown(self) -> None:
        self._session.close()
