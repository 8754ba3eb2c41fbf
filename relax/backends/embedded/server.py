"""HTTP layer of the embedded engine: SGLang's native HTTP API over `EmbeddedEngine`.

Run:  python -m relax.backends.embedded.server --model-path DIR --host 127.0.0.1 --port P
          [--dtype float32] [--max-running-requests 64] [--random-seed S]

Endpoints (request / response schemas follow SGLang's `http_server.py` and `io_struct.py`):

- POST /generate   `text` | `input_ids` (one prompt or a list), `sampling_params` (dict or list),
  `return_logprob`, `logprob_start_len`, `top_logprobs_num`, `rid`, `return_routed_experts` (also as
  `custom_labels["return_routed_experts"]`; meta_info `routed_experts`, see `routing.py`),
  `custom_labels["sampling_seeds"]` (comma-separated, one `sampling_seed` per prompt of a batch), `lora_path`
  (the loaded adapter's name, or one per prompt; None: the base; see `lora.py` for /load_lora_adapter and
  /unload_lora_adapter). Answers
  `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
  ["output_token_logprobs": [[logprob, token_id, null], ...], "input_token_logprobs", ...]}}`,
  or a list of those for batched input (prompt-major when `n` > 1). `finish_reason` is
  `{"type": "stop", "matched": token_id | stop_str}`, `{"type": "length", "length": N}` or
  `{"type": "abort", "message": ...}`. `output_ids` include a matched stop token (so
  `len(output_ids) == completion_tokens == len(output_token_logprobs)`); `text` drops it and a
  matched stop string unless `no_stop_trim`. Log-prob convention (details in `sampling.py`):
  float32 `log_softmax(logits / T)[sampled token]` from the raw logits, before top-k/top-p/min-p
  truncation and before min_new_tokens masking; T = temperature, and T = 1 when temperature is 0
  (greedy). It equals a plain HF forward pass on prompt + output with logits divided by T.
  Streaming (`stream: true`) is not supported (400).
- GET /health (scheduler alive), GET /health_generate (a 1-token generation; 200 without
  generating while paused), GET /get_model_info | /model_info, GET /get_server_info |
  /server_info, GET /get_load, GET /get_weight_version, GET /v1/models, GET /metrics (Prometheus text with
  SGLang's metric names, `metrics_text.py`; needs the key like control endpoints).
- POST /flush_cache (identical prompts share a prefill within one prefill group only, `prefix.py`, so there is
  nothing to flush: always succeeds), POST /abort_request
  `{"rid"}` | `{"abort_all": true}`, POST /pause_generation `{"mode": "abort"|"in_place"|"retract"}`
  (default abort), POST /continue_generation, POST /release_memory_occupation `{"tags"}`,
  POST /resume_memory_occupation `{"tags"}` (CPU semantics in `engine.py`).
- Weights: POST /update_weights_from_tensor `{"serialized_named_tensors": [str, ...],
  "load_format": null | "flattened_bucket" | "relax_shm" | "relax_shm_bind", "flush_cache",
  "weight_version"}` (see `relax.wire.serialize`; "relax_shm" entries are JSON manifests of the
  sender's shared-memory segment, `relax.weights.shm`; "relax_shm_bind" is one such manifest of whole
  tensors that the parameters become views of, the one-copy sync, `shared_weights`; entries are per
  tensor-parallel rank in SGLang: identical entries are applied once, different entries are all
  applied); POST /update_weights_from_disk `{"model_path", "weight_version"}`; POST
  /init_weights_update_group `{"master_address", "master_port", "rank_offset", "world_size",
  "group_name", "backend"}`; POST
  /update_weights_from_distributed `{"names", "dtypes", "shapes", "group_name", "flush_cache",
  "weight_version"}`; POST /destroy_weights_update_group `{"group_name"}`; POST
  /update_weight_version `{"new_version", "abort_all_requests"}`; GET|POST /get_weights_by_name
  `{"name", "truncate_size"}`; POST /begin_weight_update and /end_weight_update (accepted no-ops,
  sglang 0.5.23 requires them around in-memory updates). Weight updates answer
  `{"success": bool, "message": str}` (400 when `success` is false).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from relax import heap
from relax.wire.auth import OPEN_ENDPOINTS, authorized, engine_api_key
from relax.backends.embedded import shared_weights
from relax.backends.embedded.engine import EmbeddedEngine, EngineError
from relax.backends.embedded.lora import add_lora_routes
from relax.backends.embedded.metrics_text import EngineMetrics
from relax.backends.embedded.sampling import SamplingParams
from relax.observability import timeline
from relax.weights import shm

logger = logging.getLogger("relax.embedded.server")

SERVER_VERSION = "relax-embedded-0.1"


def _err(message: str, status: int = 400):
    return JSONResponse(
        {"object": "error", "message": message, "type": "BadRequest" if status == 400 else "Error", "code": status,
         "error": {"message": message}},
        status_code=status,
    )


def _ok_update(message: str, status: bool = True, **extra):
    body = {"success": status, "message": message}
    body.update(extra)
    return JSONResponse(body, status_code=200 if status else 400)


def _as_list(value, n: int, what: str):
    if isinstance(value, list):
        if len(value) != n:
            raise EngineError(f"{what} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def build_requests(engine: EmbeddedEngine, body: dict) -> tuple[list, bool]:
    """Parse a /generate body into engine requests. Returns (requests, is_batch)."""
    if body.get("stream"):
        raise EngineError("stream=true is not supported by the embedded engine")
    for key in ("input_embeds", "image_data", "video_data", "audio_data"):
        if body.get(key):
            raise EngineError(f"{key} is not supported by the embedded engine")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise EngineError("exactly one of text or input_ids must be given")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise EngineError("input_ids must be a non-empty list")
        is_batch = isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
        prompts = [[int(t) for t in p] for p in prompts]
    else:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        prompts = [engine.tokenize(str(t)) for t in texts]
    n_prompts = len(prompts)
    if n_prompts == 0:
        raise EngineError("empty batch")
    sps = _as_list(body.get("sampling_params") or {}, n_prompts, "sampling_params")
    rlp = _as_list(body.get("return_logprob") or False, n_prompts, "return_logprob")
    lsl = _as_list(body.get("logprob_start_len", -1), n_prompts, "logprob_start_len")
    tln = _as_list(body.get("top_logprobs_num") or 0, n_prompts, "top_logprobs_num")
    # SGLang's field, or a custom label (sglang-router 0.3.2 drops the field but forwards custom_labels)
    labels = body.get("custom_labels") if isinstance(body.get("custom_labels"), dict) else {}
    wants_routes = str(labels.get("return_routed_experts", "")).lower() in ("1", "true")
    rre = _as_list(body.get("return_routed_experts") or wants_routes, n_prompts, "return_routed_experts")
    adapters = [engine.lora.check(a) for a in _as_list(body.get("lora_path"), n_prompts, "lora_path")]
    # Relax's batched group requests (relax.rollout.generate.SEEDS_LABEL): each prompt's sampling_seed, where
    # SGLang would take a list of sampling_params that sglang-router 0.3.2 refuses
    seeds = labels.get("sampling_seeds")
    if seeds is not None:
        try:
            seeds = [int(x) for x in str(seeds).split(",")]
        except ValueError:
            raise EngineError(f"custom_labels.sampling_seeds must be comma-separated integers, got {seeds!r}") from None
        if len(seeds) != n_prompts:
            raise EngineError(f"custom_labels.sampling_seeds has {len(seeds)} seeds for {n_prompts} prompts")
    rid = body.get("rid")
    reqs = []
    for i, prompt in enumerate(prompts):
        try:
            base = SamplingParams.from_dict(sps[i])
        except (ValueError, TypeError) as exc:
            raise EngineError(str(exc)) from None
        if seeds is not None:
            base.sampling_seed = seeds[i]
        n = base.n
        if isinstance(rid, list):
            rid_i = rid[i]
        elif rid is not None:
            rid_i = f"{rid}_{i}" if is_batch else str(rid)
        else:
            rid_i = None
        if n > 1:
            is_batch = True
        for j in range(n):
            params = base.copy() if j else base  # parsed and validated once per prompt
            if params.sampling_seed is not None and j:
                params.sampling_seed = base.sampling_seed + j
            this_rid = rid_i if (n == 1 or rid_i is None) else f"{rid_i}_{j}"
            reqs.append(
                engine.make_request(
                    prompt,
                    params,
                    rid=this_rid,
                    return_logprob=bool(rlp[i]),
                    top_logprobs_num=int(tln[i] or 0),
                    logprob_start_len=int(-1 if lsl[i] is None else lsl[i]),
                    return_routed_experts=bool(rre[i]),
                )
            )
            reqs[-1].lora_name = adapters[i]
    return reqs, is_batch


async def _all_results(futures: list) -> list:
    """The results of the engine's futures (the first exception raises), with one wake-up of the event loop when
    the last one is done: awaiting each (`asyncio.wrap_future`) costs a cross-thread call per request, 512 per
    step of the embedded default, in the thread that also serves HTTP."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    left = [len(futures)]
    lock = threading.Lock()

    def finish() -> None:
        if not done.done():
            done.set_result(None)

    def one(_future) -> None:  # runs on the thread that completes the future (the scheduler)
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last and not loop.is_closed():
            loop.call_soon_threadsafe(finish)

    for f in futures:
        f.add_done_callback(one)
    if futures:
        await done
    return [f.result() for f in futures]


class _Groups:
    """torch.distributed groups joined for /update_weights_from_distributed."""

    def __init__(self):
        self.groups: dict[str, Any] = {}
        self.recent_payload: list = []


def create_app(engine: EmbeddedEngine, api_key: str | None = None):
    """The HTTP app. Every endpoint outside `OPEN_ENDPOINTS` requires `Authorization: Bearer api_key`;
    without a key those endpoints are refused outright (an engine nobody can steer is safer than one
    anybody can)."""
    app = FastAPI(title="relax embedded engine", version=SERVER_VERSION)
    groups = _Groups()

    @app.middleware("http")
    async def _require_key(request: Request, call_next):
        if request.url.path not in OPEN_ENDPOINTS and not authorized(request.headers.get("authorization"), api_key):
            why = ("this engine was started without an API key, so its control endpoints are disabled"
                   if not api_key else "missing or wrong 'Authorization: Bearer <key>' header")
            return _err(f"{request.url.path}: unauthorized ({why}; the key is the run's "
                        "RELAX_ENGINE_API_KEY)", 401)
        return await call_next(request)
    shm_cache = shm.SegmentCache()  # senders' shared-memory segments, mapped once
    started = time.time()

    async def _json(request: Request) -> dict:
        raw = await request.body()
        if not raw:
            return {}
        import json

        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise EngineError(f"invalid JSON body: {exc}") from None
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise EngineError("the JSON body must be an object")
        return data

    add_lora_routes(app, engine, _json)  # /load_lora_adapter, /unload_lora_adapter (lora.py)

    @app.exception_handler(EngineError)
    async def _engine_error(_request, exc: EngineError):
        return _err(str(exc), exc.status)

    # ------------------------------------------------------------------ generation
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = await _json(request)
        reqs, is_batch = build_requests(engine, body)
        futures = engine.submit_many(reqs)  # all at once: the body's prefill groups do not depend on timing
        results = await _all_results(futures)
        return JSONResponse(results if is_batch else results[0])

    @app.get("/health")
    async def health():
        if not engine.is_alive():
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if not engine.is_alive():
            return Response(status_code=503)
        if engine.released:
            return Response(content="memory released", status_code=503)
        if engine.paused or engine.num_running() > 0:
            return Response(status_code=200)  # busy or paused: the scheduler is alive and stepping
        params = SamplingParams.from_dict({"max_new_tokens": 1, "temperature": 0.0})
        req = engine.make_request([0], params, rid=f"HEALTH_CHECK_{time.time()}")
        req.log_metrics = False  # as SGLang's probe: the request counters show the clients' requests only
        try:
            await asyncio.wait_for(asyncio.wrap_future(engine.submit(req)), timeout=20)
        except (asyncio.TimeoutError, EngineError):
            return Response(status_code=503)
        return Response(status_code=200)

    def model_info():
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(engine.model.config, "model_type", None),
            "architectures": getattr(engine.model.config, "architectures", None),
        }

    app.get("/get_model_info")(model_info)
    app.get("/model_info")(model_info)

    def server_info():
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.tokenizer_path,
            "served_model_name": engine.served_model_name,
            "dtype": str(engine.dtype).replace("torch.", ""),
            "device": str(engine.device),
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "max_running_requests": engine.max_running_requests,
            "max_prefill_tokens": engine.max_prefill_tokens,
            "context_length": engine.context_length,
            "max_req_input_len": engine.context_length - 1,
            "random_seed": engine.random_seed,
            "weight_version": engine.weight_version,
            "update_waits_for_requests": engine.update_waits_for_requests,
            "disable_radix_cache": not engine.share_prefill,
            "memory_events": list(engine.__dict__.get("memory_events", ())),  # release/resume/update order
            "weight_update_formats": [None, "flattened_bucket", shm.LOAD_FORMAT, shm.LOAD_FORMAT_BIND],
            **shared_weights.server_info(engine),  # what a relax_shm_bind sender must not cast
            "internal_states": [
                {
                    "paused": engine.paused,
                    "memory_released": engine.released,
                    "num_running_reqs": engine.num_running(),
                    "num_waiting_reqs": engine.num_waiting(),
                    **engine.stats,
                }
            ],
            "version": SERVER_VERSION,
            "engine": "relax-embedded",
            "uptime_s": time.time() - started,
        }

    app.get("/get_server_info")(server_info)
    app.get("/server_info")(server_info)

    @app.get("/get_load")
    async def get_load():
        return [
            {
                "dp_rank": 0,
                "num_reqs": engine.num_running() + engine.num_waiting(),
                "num_waiting_reqs": engine.num_waiting(),
                "num_tokens": engine.num_tokens_in_use(),
            }
        ]

    metrics = EngineMetrics(engine)

    @app.get("/metrics")
    async def prometheus_metrics():
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.weight_version}

    @app.get("/v1/models")
    async def v1_models():
        return {
            "object": "list",
            "data": [
                {
                    "id": engine.served_model_name,
                    "object": "model",
                    "owned_by": "relax",
                    "root": engine.served_model_name,
                    "max_model_len": engine.context_length,
                }
            ],
        }

    # ------------------------------------------------------------------ control
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        # Shared-prompt prefill (prefix.py) reuses rows within one prefill group only: nothing to drop.
        return PlainTextResponse("Cache flushed.\n(The embedded engine keeps no prefix cache across prefills.)\n")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _json(request)
        if body.get("abort_all"):
            engine.abort(abort_all=True)
        elif body.get("rid") is not None:
            rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
            for rid in rids:
                engine.abort(rid=str(rid))
        else:
            raise EngineError("give rid or abort_all")
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await _json(request)
        await asyncio.to_thread(engine.pause, body.get("mode") or "abort")
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory(request: Request):
        body = await _json(request)
        res = await asyncio.wrap_future(engine.release_memory(body.get("tags")))
        return {"success": True, "message": "memory released", **res}

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory(request: Request):
        body = await _json(request)
        res = await asyncio.wrap_future(engine.resume_memory(body.get("tags")))
        return {"success": True, "message": "memory resumed", **res}

    # ------------------------------------------------------------------ weights
    @app.post("/begin_weight_update")
    async def begin_weight_update():
        return {"success": True, "message": "ok (no-op in the embedded engine)"}

    @app.post("/end_weight_update")
    async def end_weight_update():
        return {"success": True, "message": "ok (no-op in the embedded engine)"}

    async def _apply(named, version, what: str, t0: float):
        try:
            res = await asyncio.wrap_future(engine.update_weights(named, version))
        except EngineError as exc:
            return _ok_update(str(exc), False)
        msg = f"Succeeded to update model weights ({what}, {res['num_tensors']} tensors)."
        if version is not None:
            msg += f" Weight version updated to {version}."
        return _ok_update(msg, True, weight_version=engine.weight_version, elapsed_s=time.perf_counter() - t0)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        from relax.wire.serialize import deserialize_named_tensors

        t0 = time.perf_counter()
        body = await _json(request)
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries:
            return _ok_update("serialized_named_tensors must be a non-empty list", False)
        load_format = body.get("load_format")
        unique = list(dict.fromkeys(entries))  # SGLang: one (identical) entry per TP rank
        if load_format == shm.LOAD_FORMAT_BIND:  # one copy: parameters become views of the sender's segment
            try:
                if len(unique) != 1:
                    raise ValueError("a relax_shm_bind update is one manifest")
                obj = shm.parse_manifest(unique[0])
                pieces = list(shm.manifest_views(obj, shm_cache))
                segment = shm_cache.get(str(obj["segment"]), int(obj["segment_bytes"]))
            except Exception as exc:
                return _ok_update(f"could not read the relax_shm_bind manifest: {exc}", False)
            try:
                res = await asyncio.wrap_future(engine.bind_weights(pieces, segment, body.get("weight_version")))
            except EngineError as exc:
                return _ok_update(str(exc), False)
            return _ok_update(f"Succeeded to update model weights (relax_shm_bind, {res['bound']} bound, "
                              f"{res['copied']} copied).", True, weight_version=engine.weight_version,
                              elapsed_s=time.perf_counter() - t0, apply_s=res["apply_s"])
        if load_format == shm.LOAD_FORMAT:  # JSON manifests of views on the sender's shared memory
            try:
                pieces = [p for e in unique for p in shm.manifest_views(shm.parse_manifest(e), shm_cache)]
            except Exception as exc:
                return _ok_update(f"could not read the relax_shm manifest: {exc}", False)
            try:
                res = await asyncio.wrap_future(engine.update_weight_ranges(pieces, body.get("weight_version")))
            except EngineError as exc:
                return _ok_update(str(exc), False)
            return _ok_update(f"Succeeded to update model weights (relax_shm, {res['num_tensors']} pieces).", True,
                              weight_version=engine.weight_version, elapsed_s=time.perf_counter() - t0,
                              apply_s=res["apply_s"])

        def load():
            named = []
            for e in unique:
                named.extend(deserialize_named_tensors(e, load_format))
            return named

        try:
            named = await asyncio.to_thread(load)
        except Exception as exc:
            return _ok_update(f"could not deserialize serialized_named_tensors: {exc!r}", False)
        # Keep the senders' shared buffers mapped until the next update: a sender that reuses its
        # staging buffers (EngineClient does) is then read without re-mapping / page faults. The
        # pages are the sender's own, so this costs no extra memory.
        groups.recent_payload = [t for _, t in named]
        return await _apply(named, body.get("weight_version"), "tensor", t0)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        t0 = time.perf_counter()
        body = await _json(request)
        path = body.get("model_path")
        if not path:
            return _ok_update("model_path is required", False, num_paused_requests=0)
        try:
            named = await asyncio.to_thread(load_hf_weights, path)
        except Exception as exc:
            return _ok_update(f"could not read weights from {path}: {exc}", False, num_paused_requests=0)
        resp = await _apply(named, body.get("weight_version"), f"disk {path}", t0)
        if resp.status_code == 200:
            engine.model_path = path
        import json

        data = json.loads(resp.body)
        data["num_paused_requests"] = 0
        return JSONResponse(data, status_code=resp.status_code)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        from relax.weights.distributed import init_custom_process_group

        body = await _json(request)
        try:
            name = body.get("group_name") or "weight_update_group"
            rank = int(body.get("rank_offset", 1))
            world_size = int(body["world_size"])
            backend = body.get("backend") or "gloo"
            if backend == "nccl" and not torch.cuda.is_available():
                backend = "gloo"
            pg = await asyncio.to_thread(
                init_custom_process_group,
                backend=backend,
                master_address=str(body["master_address"]),
                master_port=int(body["master_port"]),
                rank=rank,
                world_size=world_size,
                group_name=name,
            )
        except Exception as exc:
            return _ok_update(f"Failed to init group: {exc!r}", False)
        groups.groups[name] = pg
        return _ok_update(f"Succeeded to initialize custom process group {name} (rank {rank}/{world_size}).")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        from relax.weights.distributed import receive_broadcast

        t0 = time.perf_counter()
        body = await _json(request)
        name = body.get("group_name") or "weight_update_group"
        pg = groups.groups.get(name)
        if pg is None:
            return _ok_update(f"no weight update group named {name!r}; call /init_weights_update_group", False)
        if body.get("load_format") not in (None, "direct"):
            return _ok_update(f"load_format {body.get('load_format')!r} is not supported here", False)
        try:
            names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
            named = await asyncio.to_thread(receive_broadcast, pg, names, dtypes, shapes)
        except Exception as exc:
            return _ok_update(f"Failed to receive weights: {exc!r}", False)
        return await _apply(named, body.get("weight_version"), "distributed", t0)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        from relax.weights.distributed import destroy_process_group

        body = await _json(request)
        name = body.get("group_name") or "weight_update_group"
        pg = groups.groups.pop(name, None)
        if pg is None:
            return _ok_update(f"no weight update group named {name!r}", False)
        await asyncio.to_thread(destroy_process_group, pg)
        return _ok_update(f"destroyed {name}")

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await _json(request)
        if body.get("new_version") is None:
            return _ok_update("new_version is required", False)
        if body.get("abort_all_requests"):
            engine.abort(abort_all=True)
        engine.set_weight_version(str(body["new_version"]))
        return _ok_update(f"Weight version updated to {body['new_version']}", True, new_version=body["new_version"])

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        body = await _json(request)
        if not body:
            body = dict(request.query_params)
        name = body.get("name")
        if not name:
            raise EngineError("name is required")
        t = await asyncio.wrap_future(engine.call(lambda: engine.get_weight(name), name="get_weight"))
        k = int(body.get("truncate_size", 100))
        return JSONResponse(t.float().flatten()[:k].tolist())

    return app


def load_hf_weights(path: str) -> list[tuple[str, torch.Tensor]]:
    """All tensors of a Hugging Face model folder (safetensors, or pytorch_model*.bin)."""
    import glob

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    named: list[tuple[str, torch.Tensor]] = []
    if files:
        from safetensors.torch import load_file

        for f in files:
            named.extend(load_file(f, device="cpu").items())
        return named
    bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {path}")
    for f in bins:
        named.extend(torch.load(f, map_location="cpu", weights_only=True).items())
    return named


def _watch_parent(ppid: int, on_exit) -> None:
    """Exit when the parent that started us is gone (no orphans if a test runner dies)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:
            logger.warning("parent process %d is gone; shutting down", ppid)
            on_exit()
            return


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Relax embedded engine (SGLang-compatible HTTP API, CPU)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None,
                   help="key that control endpoints require (as SGLang's --api-key); default: the environment "
                        "variable RELAX_ENGINE_API_KEY, which keeps it off the command line")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--attn-implementation", default=None)
    p.add_argument(
        "--update-waits-for-requests",
        action="store_true",
        help="weight updates wait until no request is running (SGLang's default); otherwise they "
        "apply at the next decode-step boundary",
    )
    p.add_argument("--offload-weights-on-release", action="store_true")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="prefill every request on its own row (SGLang's flag; by default identical prompts admitted "
                        "together are prefilled once, see prefix.py)")
    p.add_argument("--exit-with-parent", action="store_true", help="exit when the parent process dies")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    torch.set_num_threads(max(1, args.num_threads))
    timeline.set_role(f"engine {args.host}:{args.port}")
    import uvicorn

    engine = EmbeddedEngine(
        args.model_path,
        tokenizer_path=args.tokenizer_path,
        dtype=args.dtype,
        device=args.device,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        context_length=args.context_length,
        random_seed=args.random_seed,
        weight_version=args.weight_version,
        update_waits_for_requests=args.update_waits_for_requests,
        offload_weights_on_release=args.offload_weights_on_release,
        attn_implementation=args.attn_implementation,
        served_model_name=args.served_model_name,
        share_prefill=not args.disable_radix_cache,
    ).start()
    app = create_app(engine, api_key=args.api_key or engine_api_key())
    heap.freeze()  # torch, transformers, the model, the app: ~400k objects no collection needs to scan
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=5,
                            # Keep idle connections open longer than the router's connection pool does: with
                            # uvicorn's 5 s default, a pooled connection idle through a training step could be
                            # closed just as the router reuses it ("error sending request"), and enough such
                            # failures open the router's circuit breaker for the only engine.
                            timeout_keep_alive=600)
    server = uvicorn.Server(config)
    if args.exit_with_parent:
        ppid = os.getppid()

        def stop():
            server.should_exit = True

        threading.Thread(target=_watch_parent, args=(ppid, stop), daemon=True).start()
    try:
        server.run()
    finally:
        engine.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
