"""``remote_rm``: score by HTTP POST to a reward-model server.

Request body (JSON): ``{"response": ..., "label": ..., "metadata": ...}`` (or what
``payload_fn(response, label, metadata)`` returns). The reply is JSON: a number,
or an object that is returned as-is (a dict reward; the runner picks
``reward_key`` from it, by default ``"reward"`` then ``"score"``).

Failures (connection errors, timeouts, HTTP 408/429/5xx, unparsable JSON) are
retried with exponential backoff: ``backoff * 2**attempt`` seconds, capped at
``max_backoff``. Other 4xx statuses are not retried. After the last attempt a
``RemoteRewardError`` names the URL, the number of attempts and the last error.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Optional

__all__ = ["RemoteRewardModel", "RemoteRewardError"]


class RemoteRewardError(RuntimeError):
    """The reward server could not produce a reward."""


class _Retryable(Exception):
    pass


class _Fatal(Exception):
    pass


def _check_status(status: int, body: str) -> None:
    if status == 200:
        return
    msg = f"HTTP {status}: {body[:200]}"
    if status in (408, 429) or status >= 500:
        raise _Retryable(msg)
    raise _Fatal(msg)


def _parse(body: str) -> Any:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise _Retryable(f"reply is not JSON ({e}): {body[:200]!r}") from None
    if isinstance(data, bool) or not isinstance(data, (int, float, dict)):
        raise _Fatal(f"reply must be a number or a JSON object, got {type(data).__name__}: {body[:200]!r}")
    return float(data) if not isinstance(data, dict) else data


class RemoteRewardModel:
    """A reward function backed by an HTTP server; callable sync (``requests``) and async (``acall``, aiohttp).

    ``url`` may be None, in which case each call needs ``metadata["rm_url"]``.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        *,
        timeout: float = 30.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        headers: Optional[dict] = None,
        payload_fn: Optional[Callable[[str, Any, dict], Any]] = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.url = url
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.headers = dict(headers or {})
        self.payload_fn = payload_fn

    # -- helpers
    def _url_for(self, metadata: Optional[dict]) -> str:
        url = (metadata or {}).get("rm_url") or self.url
        if not url:
            raise RemoteRewardError("remote_rm needs a URL: pass rm_url= to get_reward_fn or set metadata['rm_url']")
        return str(url)

    def _payload(self, response: str, label: Any, metadata: Optional[dict]) -> Any:
        if self.payload_fn is not None:
            return self.payload_fn(response, label, metadata or {})
        return {"response": response, "label": label, "metadata": metadata or {}}

    def _delay(self, attempt: int) -> float:
        return min(self.max_backoff, self.backoff * (2**attempt))

    def _error(self, url: str, attempts: int, last: BaseException) -> RemoteRewardError:
        return RemoteRewardError(
            f"remote reward model at {url} failed after {attempts} attempt(s): {type(last).__name__}: {last}"
        )

    # -- sync
    def __call__(self, response: str, label: Any, metadata: Optional[dict] = None) -> Any:
        import requests

        url = self._url_for(metadata)
        payload = self._payload(response, label, metadata)
        last: BaseException = RuntimeError("no attempt made")
        attempts = 0
        for attempt in range(self.max_retries + 1):
            attempts = attempt + 1
            try:
                r = requests.post(url, json=payload, timeout=self.timeout, headers=self.headers)
                _check_status(r.status_code, r.text)
                return _parse(r.text)
            except _Fatal as e:
                raise self._error(url, attempts, e) from None
            except (_Retryable, requests.RequestException) as e:
                last = e
            if attempt < self.max_retries:
                time.sleep(self._delay(attempt))
        raise self._error(url, attempts, last)

    # -- async
    async def acall(self, response: str, label: Any, metadata: Optional[dict] = None) -> Any:
        import aiohttp

        url = self._url_for(metadata)
        payload = self._payload(response, label, metadata)
        last: BaseException = RuntimeError("no attempt made")
        attempts = 0
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout, headers=self.headers) as session:
            for attempt in range(self.max_retries + 1):
                attempts = attempt + 1
                try:
                    async with session.post(url, json=payload) as r:
                        body = await r.text()
                        _check_status(r.status, body)
                        return _parse(body)
                except _Fatal as e:
                    raise self._error(url, attempts, e) from None
                except (_Retryable, aiohttp.ClientError, asyncio.TimeoutError) as e:
                    last = e
                if attempt < self.max_retries:
                    await asyncio.sleep(self._delay(attempt))
        raise self._error(url, attempts, last)

    def __repr__(self) -> str:
        return f"RemoteRewardModel(url={self.url!r}, timeout={self.timeout}, max_retries={self.max_retries})"
