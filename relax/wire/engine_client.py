"""A synchronous client for an engine speaking SGLang's native HTTP API.

Works against the embedded engine, real SGLang and the sglang-router (for the endpoints a router
forwards). Every call has a timeout; a failure raises `EngineRequestError`, whose message names
the engine URL and the endpoint (and, for a request that got no answer in time, the flag that set
the deadline when the client was given one, `deadline_flag`).

Weight pushes build on this client in `relax.weights` (which imports it, never the other way round,
except for the payload format of `relax.wire.serialize`); the distributed group is
`relax.weights.distributed.WeightUpdateGroup`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import requests
import torch

from relax.wire.auth import auth_headers
from relax.wire.serialize import SharedBufferPool, iter_buckets, payload_entries, serialize_named_tensors

logger = logging.getLogger(__name__)


class EngineRequestError(RuntimeError):
    """An engine request failed (connection error, timeout, non-2xx answer, success=false)."""

    def __init__(self, base_url: str, endpoint: str, message: str, status: int | None = None, body: Any = None,
                 *, timed_out: bool = False):
        self.base_url = base_url
        self.endpoint = endpoint
        self.status = status
        self.body = body
        self.timed_out = timed_out
        where = f"{base_url}{endpoint}"
        code = f" HTTP {status}" if status is not None else ""
        super().__init__(f"engine request {where} failed{code}: {message}")


class EngineClient:
    """`api_key`: what control calls present (`relax.wire.auth`); default the run's key from the
    environment. `deadline_flag`: the flag `timeout_s` came from, named when a request gets no answer."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, *, session: requests.Session | None = None,
                 api_key: str | None = None, deadline_flag: str | None = None):
        if not base_url.startswith(("http://", "https://")):
            base_url = "http://" + base_url
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.deadline_flag = deadline_flag
        self.session = session or requests.Session()
        self.session.headers.update(auth_headers(api_key))
        self._has_begin_end: bool | None = None
        self._tp_size: int | None = None
        self.buffer_pool = SharedBufferPool()

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    def close(self) -> None:
        self.session.close()

    # ----------------------------------------------------------------------------- transport
    def _request(
        self,
        method: str,
        endpoint: str,
        payload: Any = None,
        *,
        timeout_s: float | None = None,
        allow_404: bool = False,
        expect_json: bool = True,
        check_success: bool = False,
    ) -> Any:
        url = self.base_url + endpoint
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            resp = self.session.request(method, url, json=payload, timeout=timeout)
        except requests.Timeout:
            flag = f" ({self.deadline_flag})" if self.deadline_flag else ""
            raise EngineRequestError(self.base_url, endpoint, f"timed out: no answer within {timeout:g} s{flag}",
                                     timed_out=True) from None
        except requests.RequestException as exc:
            raise EngineRequestError(self.base_url, endpoint, f"{type(exc).__name__}: {exc}") from None
        if resp.status_code == 404 and allow_404:
            return None
        body: Any
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        if not 200 <= resp.status_code < 300:
            raise EngineRequestError(self.base_url, endpoint, _error_text(body), resp.status_code, body)
        if check_success and isinstance(body, dict) and body.get("success") is False:
            raise EngineRequestError(self.base_url, endpoint, _error_text(body), resp.status_code, body)
        return body if expect_json else resp

    def _get(self, endpoint: str, **kw) -> Any:
        return self._request("GET", endpoint, **kw)

    def _post(self, endpoint: str, payload: Any = None, **kw) -> Any:
        return self._request("POST", endpoint, payload if payload is not None else {}, **kw)

    # ----------------------------------------------------------------------------- generation
    def generate(
        self,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        sampling_params: dict | Sequence[dict] | None = None,
        *,
        text: str | Sequence[str] | None = None,
        return_logprob: bool = False,
        rid: str | Sequence[str] | None = None,
        timeout_s: float | None = None,
        **extra: Any,
    ) -> dict | list[dict]:
        """POST /generate; returns SGLang's response (a list for batched input)."""
        payload: dict[str, Any] = {"sampling_params": sampling_params or {}}
        if input_ids is not None:
            payload["input_ids"] = [list(x) for x in input_ids] if input_ids and isinstance(input_ids[0], (list, tuple)) else list(input_ids)
        if text is not None:
            payload["text"] = text
        if return_logprob:
            payload["return_logprob"] = True
        if rid is not None:
            payload["rid"] = rid
        payload.update(extra)
        return self._post("/generate", payload, timeout_s=timeout_s)

    # ----------------------------------------------------------------------------- health / info
    def health(self, timeout_s: float = 10.0) -> bool:
        """True when GET /health answers 200 (False on any error or status)."""
        try:
            return self.session.get(self.base_url + "/health", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def health_generate(self, timeout_s: float = 60.0) -> bool:
        try:
            return self.session.get(self.base_url + "/health_generate", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(self, timeout_s: float = 120.0, interval_s: float = 0.2) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.health(timeout_s=min(5.0, timeout_s)):
            if time.monotonic() > deadline:
                raise EngineRequestError(self.base_url, "/health", f"not healthy within {timeout_s:.0f}s")
            time.sleep(interval_s)

    def model_info(self) -> dict:
        body = self._get("/get_model_info", allow_404=True)
        return body if body is not None else self._get("/model_info")

    def server_info(self) -> dict:
        body = self._get("/get_server_info", allow_404=True)
        return body if body is not None else self._get("/server_info")

    def tp_size(self) -> int:
        if self._tp_size is None:
            try:
                self._tp_size = int(self.server_info().get("tp_size", 1) or 1)
            except EngineRequestError:
                self._tp_size = 1
        return self._tp_size

    def get_load(self) -> Any:
        return self._get("/get_load")

    def num_requests(self) -> int:
        """Requests the engine holds, running or waiting: `num_reqs` of /get_load (the embedded engine, SGLang
        before 0.5.2x), else `num_running_reqs + num_waiting_reqs` of /v1/loads (SGLang 0.5.23 has only that)."""
        load = self._get("/get_load", allow_404=True)
        if load is not None:
            rows = load if isinstance(load, list) else [load]
            return sum(int(r.get("num_reqs", 0)) for r in rows)
        rows = self._get("/v1/loads?include=core")["loads"]
        return sum(int(r.get("num_running_reqs", 0)) + int(r.get("num_waiting_reqs", 0)) for r in rows)

    def get_weight_version(self) -> str | None:
        body = self._get("/get_weight_version", allow_404=True)
        if body is None:  # older SGLang: only in model info
            body = self.model_info()
        return None if body.get("weight_version") is None else str(body["weight_version"])

    # ----------------------------------------------------------------------------- control
    def flush_cache(self) -> None:
        self._post("/flush_cache", expect_json=False)

    def pause(self, mode: str | None = None) -> None:
        """POST /pause_generation (SGLang default mode "abort"; "in_place" keeps requests)."""
        self._post("/pause_generation", {"mode": mode} if mode else {})

    def resume(self) -> None:
        self._post("/continue_generation")

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        if rid is None and not abort_all:
            raise ValueError("give rid or abort_all=True")
        payload = {"abort_all": True} if abort_all else {"rid": rid}
        self._post("/abort_request", payload, expect_json=False)

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self._post("/release_memory_occupation", {"tags": list(tags)} if tags else {}, expect_json=False)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self._post("/resume_memory_occupation", {"tags": list(tags)} if tags else {}, expect_json=False)

    # ----------------------------------------------------------------------------- weights
    def _begin_weight_update(self) -> None:
        if self._has_begin_end is False:
            return
        body = self._post("/begin_weight_update", {}, allow_404=True, check_success=True)
        self._has_begin_end = body is not None

    def _end_weight_update(self) -> None:
        if self._has_begin_end:
            self._post("/end_weight_update", {}, allow_404=True, check_success=True)

    def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
        buffer_bytes: int = 512 << 20,
        *,
        load_format: str | None = "flattened_bucket",
        flush_cache: bool = True,
        tp_size: int | None = None,
    ) -> dict:
        """Send weights through shared memory, at most `buffer_bytes` per request.

        The weight version is sent with the last request only, so the engine reports the new
        version once every tensor has arrived. Returns `{"num_requests", "num_tensors",
        "num_bytes", "seconds"}`. The engine must run on this host (shared memory). Tensors are
        staged in this client's reusable shared-memory buffers (`self.buffer_pool`, up to
        `buffer_bytes` per dtype stay allocated; `self.buffer_pool.clear()` frees them).
        """
        return update_weights_from_tensor_many(
            [self], named_tensors, weight_version, buffer_bytes, load_format=load_format,
            flush_cache=flush_cache, tp_sizes=[tp_size] if tp_size else None, pool=self.buffer_pool,
        )

    def update_weights_from_disk(self, path: str, weight_version: str | None = None, **extra: Any) -> dict:
        payload: dict[str, Any] = {"model_path": str(path)}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        payload.update(extra)
        return self._post("/update_weights_from_disk", payload, check_success=True)

    def set_weight_version(self, version: str, abort_all_requests: bool = False) -> dict:
        return self._post(
            "/update_weight_version",
            {"new_version": str(version), "abort_all_requests": abort_all_requests},
            check_success=True,
        )

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return self._post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    # --- distributed (gloo/NCCL broadcast): the group (relax.weights.distributed) posts these ----
    def _post_init_group(self, **payload: Any) -> dict:
        return self._post("/init_weights_update_group", payload, check_success=True)

    def _post_update_distributed(self, payload: dict) -> dict:
        self._begin_weight_update()
        try:
            return self._post("/update_weights_from_distributed", payload, check_success=True)
        finally:
            self._end_weight_update()


def update_weights_from_tensor_many(
    clients: Sequence[EngineClient],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    weight_version: str | None = None,
    buffer_bytes: int = 512 << 20,
    *,
    load_format: str | None = "flattened_bucket",
    flush_cache: bool = True,
    tp_sizes: Sequence[int] | None = None,
    pool: SharedBufferPool | None = None,
) -> dict:
    """Push the same weights to several engines on this host: each bucket is staged in shared
    memory once and posted to every engine concurrently (each maps the same memory).

    Raises the first `EngineRequestError` after every engine has answered the failing bucket.
    """
    clients = list(clients)
    if not clients:
        raise ValueError("no engines to update")
    t0 = time.perf_counter()
    tps = list(tp_sizes) if tp_sizes else [c.tp_size() for c in clients]
    buckets = list(iter_buckets(named_tensors, buffer_bytes, group_by_dtype=load_format == "flattened_bucket"))
    if not buckets:
        raise ValueError("no tensors to send")
    n_tensors = sum(len(b) for b in buckets)
    n_bytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    pool = pool if pool is not None else SharedBufferPool()

    def post(client: EngineClient, tp: int, data: str, last: bool) -> None:
        payload: dict[str, Any] = {
            "serialized_named_tensors": payload_entries(data, tp),
            "load_format": load_format,
            "flush_cache": bool(flush_cache) and last,
        }
        if weight_version is not None and last:
            payload["weight_version"] = str(weight_version)
        client._post("/update_weights_from_tensor", payload, check_success=True)

    def each(fn, *args_per_client) -> None:
        if len(clients) == 1:
            fn(clients[0], *(a[0] for a in args_per_client))
            return
        with ThreadPoolExecutor(max_workers=len(clients)) as ex:
            futs = [ex.submit(fn, c, *(a[i] for a in args_per_client)) for i, c in enumerate(clients)]
            errors = [f.exception() for f in futs if f.exception() is not None]
        if errors:
            raise errors[0]

    with pool.lock:
        each(lambda c: c._begin_weight_update())
        try:
            for i, bucket in enumerate(buckets):
                data, keepalive = serialize_named_tensors(bucket, load_format, pool=pool)
                last = i == len(buckets) - 1
                each(lambda c, tp: post(c, tp, data, last), tps)
                del keepalive
        finally:
            each(lambda c: c._end_weight_update())
    return {
        "num_requests": len(buckets),
        "num_tensors": n_tensors,
        "num_bytes": n_bytes,
        "num_engines": len(clients),
        "seconds": time.perf_counter() - t0,
    }


def _error_text(body: Any) -> str:
    if isinstance(body, dict):
        for key in ("message", "detail", "error"):
            val = body.get(key)
            if isinstance(val, dict):
                val = val.get("message", val)
            if val:
                return str(val)
    text = str(body)
    return text[:500] if text else "(empty body)"
