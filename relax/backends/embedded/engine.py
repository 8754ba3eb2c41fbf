"""The embedded engine core: a Hugging Face causal LM behind a batching scheduler thread.

No HTTP here (see `server.py`). One scheduler thread owns the model; everything that touches it
(prefill, decode, weight copies) runs on that thread, between decode steps.

Batching (continuous): pending requests are prefilled together as one left-padded batch with a
fresh KV cache (`past_key_values`; identical prompts of the group once, their rows copied: `prefix.py`,
SGLang's prefix reuse for GRPO groups; one batched /generate is queued at once, `submit_many`, so the
groups do not depend on timing), their first token is sampled, and the group is merged into
the running batch (KV caches left-padded to a common length and concatenated on the batch
dimension). Every step then decodes one token for every running request with explicit
`position_ids` and a 2-D padding mask, so padding never changes a result beyond float noise.
Requests leave the batch independently (stop token, stop string, length, abort) and are answered
at once; leading columns that only padding uses are trimmed. Models whose cache layers are not
plain full-attention `DynamicLayer`s (sliding-window, hybrid) fall back to admitting new requests
only when the running batch is empty.

Sampling: a request with SGLang's `sampling_params["sampling_seed"]` draws the token at sequence
position p from a generator seeded by (seed, p) alone (`sampling.seeded_position_seed`), so what it
samples does not depend on the requests it is batched with, on the engine's `random_seed`, or on an
abort + resume (prompt + partial response, same seed); only float noise of batched forward passes
remains (log-prob differences of ~1e-6). Requests without a seed share the engine's generator.

Weight updates are commands executed by the scheduler thread at a step boundary: a step never
mixes weights, and all tensors of one update request are applied together (validated first, so a
bad request changes nothing). By default an update does not wait for running requests, which
continue on the new weights (like SGLang after `pause_generation(mode="in_place")`); with
`update_waits_for_requests=True` it waits until no request is running and holds back new ones
(like SGLang's default), so that each response is produced by one weight version. The one-copy
shared-memory format (`relax_shm_bind`, `shared_weights.py`) points parameters at views of the sender's
segment instead of copying, in the same kind of command.

`release_memory()` / `resume_memory()` on CPU: there is no device memory to hand back. Release
aborts running and waiting requests (dropping their KV caches) and refuses generation until
resume. Weights stay resident unless `offload_weights_on_release=True`, in which case their
storage is freed and re-allocated (zero-filled) on resume, to be overwritten by a weight update,
as with SGLang without a CPU weight backup.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Iterable

import torch

from relax.backends.embedded import prefix, shared_weights
from relax.backends.embedded.lora import LoraServing
from relax.backends.embedded.weight_names import expert_aliases
from relax.backends.embedded.routing import RouteCapture
from relax.backends.embedded.sampling import SamplingParams, sample_batch, seeded_position_seed
from relax.observability import timeline

logger = logging.getLogger(__name__)

from relax.backends.embedded.requests import (  # noqa: F401  (re-exported)
    EngineError, GenRequest, _cache_layers_mergeable, _Command, _left_pad, _RunningBatch, check_finish,
    checked_prompt, prompt_logprobs, resolve_dtype, response_payload,
)


class EmbeddedEngine:
    """Continuous-batching generation over a transformers causal LM on one device (CPU)."""

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer_path: str | None = None,
        dtype: str | torch.dtype | None = "float32",
        device: str = "cpu",
        max_running_requests: int = 64,
        max_prefill_tokens: int = 16384,
        context_length: int | None = None,
        random_seed: int | None = None,
        weight_version: str = "default",
        update_waits_for_requests: bool = False,
        offload_weights_on_release: bool = False,
        attn_implementation: str | None = None,
        served_model_name: str | None = None,
        share_prefill: bool = True,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path
        self.served_model_name = served_model_name or model_path
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        self.max_running_requests = int(max_running_requests)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.update_waits_for_requests = bool(update_waits_for_requests)
        self.offload_weights_on_release = bool(offload_weights_on_release)
        self.share_prefill = bool(share_prefill)  # prefill identical prompts once (prefix.py)
        self.weight_version = str(weight_version)
        self.random_seed = int(random_seed) if random_seed is not None else int.from_bytes(os.urandom(4), "little")

        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        kwargs: dict[str, Any] = {"dtype": self.dtype}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        self.model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(self.device).eval()
        self.config = AutoConfig.from_pretrained(model_path)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        cfg_ctx = getattr(self.model.config, "max_position_embeddings", None) or 4096
        self.context_length = int(context_length or cfg_ctx)
        self.eos_ids = self._collect_eos_ids()
        self._eos_stop = frozenset(self.eos_ids)  # stop ids of most requests, one shared set
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0))
        self.generator = torch.Generator(device="cpu").manual_seed(self.random_seed)
        self._merge_ok: bool | None = None  # decided at first prefill
        # transformers 5.x calls the KV cache `cache` (in and out); 4.x `past_key_values`.
        fwd_params = inspect.signature(type(self.model).forward).parameters
        self._cache_kw = "cache" if "cache" in fwd_params else "past_key_values"
        self._routes = RouteCapture(self.model)  # return_routed_experts (R3), see routing.py
        self.lora = LoraServing(self.model)  # SGLang's LoRA endpoints: base + one adapter (lora.py)

        self._lock = threading.Condition()
        self._pending: deque[GenRequest] = deque()
        self._commands: deque[_Command] = deque()
        self._abort_rids: set[str] = set()
        self._abort_all = False
        self._abort_message = "Abort request."
        self._known_rids: set[str] = set()
        self.paused = False
        self.released = False
        self._stop = False
        self._batch: _RunningBatch | None = None
        self._prefilling: list[GenRequest] = []
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._rid_counter = itertools.count()
        self._param_shapes: dict[str, tuple[torch.Size, torch.dtype]] | None = None

        # counters (read by /get_server_info and /get_load; written by the scheduler thread)
        self.stats = {
            "num_requests_finished": 0,
            "num_generated_tokens": 0,
            "num_prompt_tokens": 0,
            "num_cached_tokens": 0,  # prompt tokens of copies that shared a prefill row (prefix.py)
            "num_decode_steps": 0,
            "num_weight_updates": 0,
            "last_weight_update_s": 0.0,
        }

    # ----------------------------------------------------------------------------- lifecycle
    def start(self) -> "EmbeddedEngine":
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="relax-embedded-scheduler", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        self._fail_everything("engine shut down")

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    # ----------------------------------------------------------------------------- helpers
    def _collect_eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen_cfg = getattr(self.model, "generation_config", None)
        for src in (getattr(gen_cfg, "eos_token_id", None), getattr(self.model.config, "eos_token_id", None),
                    self.tokenizer.eos_token_id):
            if src is None:
                continue
            if isinstance(src, (list, tuple, set)):
                ids.update(int(x) for x in src)
            else:
                ids.add(int(src))
        return ids

    def new_rid(self) -> str:
        return f"{os.urandom(8).hex()}-{next(self._rid_counter)}"  # uuid4's shape, a fraction of its cost

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def num_running(self) -> int:
        b = self._batch
        return len(b) if b is not None else 0

    def num_waiting(self) -> int:
        return len(self._pending)

    def num_tokens_in_use(self) -> int:
        b = self._batch
        return int(b.mask.sum().item()) if b is not None and b.mask.numel() else 0

    # ----------------------------------------------------------------------------- public API
    def make_request(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        return_routed_experts: bool = False,
    ) -> GenRequest:
        if return_routed_experts and not self._routes.available:
            raise EngineError("return_routed_experts: this model has no MoE routers")
        ids = checked_prompt(input_ids, self.vocab_size, self.context_length)
        params.max_new_tokens = min(params.max_new_tokens, self.context_length - len(ids))
        params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens)
        req = GenRequest(rid or self.new_rid(), ids, params, bool(return_logprob), int(top_logprobs_num or 0),
                         int(-1 if logprob_start_len is None else logprob_start_len), bool(return_routed_experts))
        if params.ignore_eos:
            req.stop_ids = frozenset(params.stop_token_ids)
        else:
            req.stop_ids = self._eos_stop.union(params.stop_token_ids) if params.stop_token_ids else self._eos_stop
        return req

    def submit(self, req: GenRequest) -> Future:
        """Queue a request; the future resolves to the response dict (see `_response`)."""
        return self.submit_many([req])[0]

    def submit_many(self, reqs: list[GenRequest]) -> list[Future]:
        """Queue requests together (one batched /generate): the scheduler sees all of them or none, so how they
        are grouped for prefill does not depend on when it woke up. All are refused if one is."""
        with self._lock:
            if self._stop or self._thread_error is not None:
                raise EngineError("the engine is shutting down or its scheduler died", status=503)
            if self.released:
                raise EngineError(
                    "memory is released (release_memory_occupation); call resume_memory_occupation first",
                    status=503,
                )
            rids = [r.rid for r in reqs]
            dup = next((x for x in rids if x in self._known_rids), None)
            if dup is None and len(set(rids)) < len(rids):
                dup = next(x for i, x in enumerate(rids) if x in rids[:i])
            if dup is not None:
                raise EngineError(f"duplicate request id {dup!r}")
            self._known_rids.update(rids)
            self._pending.extend(reqs)
            self._lock.notify_all()
        return [r.future for r in reqs]

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "Abort request.") -> None:
        with self._lock:
            if abort_all:
                self._abort_all = True
                self._abort_message = message
            elif rid is not None:
                self._abort_rids.add(rid)
            self._lock.notify_all()

    def pause(self, mode: str = "abort") -> None:
        """SGLang's pause_generation: "abort" (default) aborts everything that is running or waiting;
        "in_place" and "retract" keep running requests frozen until `resume()`. New requests wait."""
        if mode not in ("abort", "in_place", "retract"):
            raise EngineError(f"unknown pause mode {mode!r} (abort, in_place, retract)")
        with self._lock:
            self.paused = True
            if mode == "abort":
                self._abort_all = True
                self._abort_message = "Abort: generation paused."
            self._lock.notify_all()
        if mode == "abort":
            # Wait until the scheduler has answered the aborted requests.
            self.call(lambda: None).result(timeout=600)

    def resume(self) -> None:
        with self._lock:
            self.paused = False
            self._lock.notify_all()

    def call(self, fn: Callable[[], Any], *, needs_idle: bool = False, name: str = "command") -> Future:
        """Run `fn` on the scheduler thread at the next step boundary (after running requests
        finish if `needs_idle`, unless paused). Returns a Future of its result."""
        cmd = _Command(fn=fn, future=Future(), needs_idle=needs_idle, name=name)
        with self._lock:
            if self._stop:
                raise EngineError("the engine is shutting down", status=503)
            self._commands.append(cmd)
            self._lock.notify_all()
        return cmd.future

    # --- weights -----------------------------------------------------------------------------
    def _named_targets(self) -> dict[str, torch.Tensor]:
        targets: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            targets[name] = p
            targets.update(expert_aliases(name, p))  # checkpoint names of fused MoE experts (views)
        for name, b in self.model.named_buffers(remove_duplicate=False):
            targets.setdefault(name, b)
        return targets

    @staticmethod
    def _ignorable(name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq") or name.endswith(".attn.masked_bias") or name.endswith(".attn.bias")

    def _validate_named(self, named: list[tuple[str, torch.Tensor]], targets: dict[str, torch.Tensor]):
        unknown, mismatched, plan = [], [], []
        for name, t in named:
            dst = targets.get(name)
            if dst is None:
                if not self._ignorable(name):
                    unknown.append(name)
                continue
            if tuple(dst.shape) != tuple(t.shape) and dst.numel() != 0:
                mismatched.append(f"{name}: engine {tuple(dst.shape)} vs update {tuple(t.shape)}")
                continue
            plan.append((name, dst, t))
        if unknown or mismatched:
            msg = []
            if unknown:
                msg.append(f"unknown parameter names {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
            if mismatched:
                msg.append(f"shape mismatch {mismatched[:8]}")
            raise EngineError("weight update rejected, nothing changed: " + "; ".join(msg))
        return plan

    def _apply_plan(self, plan, weight_version: str | None) -> dict:
        t0 = time.perf_counter()
        with torch.no_grad():
            for _, dst, src in plan:
                dst.copy_(src)
        if weight_version is not None:
            self.weight_version = str(weight_version)
        dt = time.perf_counter() - t0
        self._log_event("update_weights", ())
        self.stats["num_weight_updates"] += 1
        self.stats["last_weight_update_s"] = dt
        return {"num_tensors": len(plan), "apply_s": dt, "weight_version": self.weight_version}

    def update_weights(
        self, named: list[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> Future:
        """Copy `(hf_name, tensor)` pairs into the model atomically at a step boundary."""

        def run():
            if self.released and self.offload_weights_on_release and self._weights_offloaded:
                raise EngineError("weights are released; resume_memory_occupation first", status=400)
            shared_weights.privatize(self)  # never write into pages of a sender's segment
            plan = self._validate_named(named, self._named_targets())
            return self._apply_plan(plan, weight_version)

        return self.call(run, needs_idle=self.update_waits_for_requests, name="update_weights")

    def update_weight_ranges(self, pieces, weight_version: str | None = None) -> Future:
        """Like `update_weights`, for pieces `(hf_name, full_shape, start, flat_src)` of a sender's shared
        memory (`relax_shm`; `shared_weights.apply_ranges`)."""
        return self.call(lambda: shared_weights.apply_ranges(self, pieces, weight_version),
                         needs_idle=self.update_waits_for_requests, name="update_weights")

    def bind_weights(self, pieces, segment: torch.Tensor, weight_version: str | None = None) -> Future:
        """One-copy update (`relax_shm_bind`): parameters become views of `segment` at a step boundary
        (`shared_weights.bind`)."""
        return self.call(lambda: shared_weights.bind(self, pieces, weight_version, segment),
                         needs_idle=self.update_waits_for_requests, name="update_weights")

    def set_weight_version(self, version: str) -> None:
        self.weight_version = str(version)

    def get_weight(self, name: str) -> torch.Tensor:
        targets = self._named_targets()
        if name not in targets:
            raise EngineError(f"no parameter named {name!r}")
        return targets[name].detach().clone()

    # --- memory --------------------------------------------------------------------------------
    _weights_offloaded = False
    _released_tags: frozenset = frozenset()

    def _log_event(self, kind: str, tags) -> None:
        """Memory and weight events in order (GET /get_server_info `memory_events`, the last 256)."""
        events = self.__dict__.setdefault("memory_events", deque(maxlen=256))
        self.__dict__["_event_seq"] = self.__dict__.get("_event_seq", 0) + 1
        events.append({"seq": self._event_seq, "event": kind, "tags": sorted(tags), "time": time.time(),
                       "weight_version": self.weight_version, "memory_released": sorted(self._released_tags)})

    def release_memory(self, tags: Iterable[str] | None = None) -> Future:
        tags = set(tags) if tags else {"weights", "kv_cache"}

        def run():
            self.released = True
            self._released_tags = frozenset(self._released_tags | tags)
            self._log_event("release", tags)
            self._abort_everything("Abort: memory released.")
            if "weights" in tags and self.offload_weights_on_release and not self._weights_offloaded:
                self._param_shapes = {}
                for name, t in self.model.named_parameters():  # parameters only: buffers stay
                    self._param_shapes[name] = (t.shape, t.dtype)
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                self._weights_offloaded = True
            return {"released": sorted(tags)}

        with self._lock:
            self.released = True  # refuse new requests immediately
        return self.call(run, name="release_memory")

    def resume_memory(self, tags: Iterable[str] | None = None) -> Future:
        tags = set(tags) if tags else {"weights", "kv_cache"}

        def run():
            # tag by tag, like SGLang: generation needs everything back; weight updates need "weights"
            self._released_tags = frozenset(self._released_tags - tags)
            self._log_event("resume", tags)
            if "weights" in tags and self._weights_offloaded and self._param_shapes is not None:
                for name, t in self.model.named_parameters():
                    shape, dtype = self._param_shapes[name]
                    if t.numel() == 0 and torch.Size(shape).numel() > 0:
                        t.data = torch.zeros(shape, dtype=dtype, device=t.device)
                self._weights_offloaded = False
            self.released = bool(self._released_tags)
            return {"resumed": sorted(tags), "still_released": sorted(self._released_tags)}

        return self.call(run, name="resume_memory")

    # ----------------------------------------------------------------------------- scheduler
    def _has_work_locked(self) -> bool:
        if self._stop or self._commands or self._abort_rids or self._abort_all:
            return True
        if self.paused or self.released:
            return False
        return bool(self._pending) or (self._batch is not None and len(self._batch) > 0)

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        busy_since, finished_before = None, 0  # --timeline-dump-dir: one span per stretch of generation
        try:
            while True:
                with self._lock:
                    while not self._has_work_locked():
                        self._lock.wait(timeout=1.0)
                    if self._stop:
                        return
                self._process_aborts()
                blocked = self._run_commands()
                if self.paused or self.released:
                    continue
                try:
                    if not blocked:
                        self._admit()
                    if self._batch is not None and len(self._batch):
                        if busy_since is None:
                            busy_since, finished_before = time.time(), self.stats["num_requests_finished"]
                        self._decode_step()
                    if busy_since is not None and not (self._batch is not None and len(self._batch)):
                        timeline.record("generate", busy_since, time.time(), cat="engine",
                                        requests=self.stats["num_requests_finished"] - finished_before)
                        busy_since = None
                except Exception as exc:
                    # A failed forward pass (bad input the checks missed, out of memory, ...) fails
                    # the requests it touched; the engine keeps serving.
                    logger.exception("generation step failed")
                    self._fail_step(f"engine error: {exc!r}")
        except BaseException as exc:  # pragma: no cover - a bug; fail loudly, answer everyone
            logger.exception("embedded engine scheduler crashed")
            self._thread_error = exc
            self._stop = True
            self._fail_everything(f"engine scheduler crashed: {exc!r}")

    def _run_commands(self) -> bool:
        """Run queued commands in order. Returns True if a command waits for idle (blocks admission)."""
        while True:
            with self._lock:
                if not self._commands:
                    return False
                cmd = self._commands[0]
                if cmd.needs_idle and self.num_running() > 0 and not self.paused:
                    return True
                self._commands.popleft()
            if not cmd.future.set_running_or_notify_cancel():
                continue
            try:
                cmd.future.set_result(cmd.fn())
            except BaseException as exc:
                cmd.future.set_exception(exc)

    def _process_aborts(self) -> None:
        with self._lock:
            abort_all, rids, message = self._abort_all, set(self._abort_rids), self._abort_message
            self._abort_all = False
            self._abort_rids.clear()
            if not abort_all and not rids:
                return
            keep = deque()
            aborted_pending = []
            for req in self._pending:
                (aborted_pending if abort_all or req.rid in rids else keep).append(req)
            self._pending = keep
        for req in aborted_pending:
            self._finish(req, {"type": "abort", "message": message})
        b = self._batch
        if b is not None:
            drop = [i for i, r in enumerate(b.reqs) if abort_all or r.rid in rids]
            for i in drop:
                self._finish(b.reqs[i], {"type": "abort", "message": message})
            if drop:
                self._remove_rows(set(drop))

    def _fail_step(self, message: str) -> None:
        group, self._prefilling = self._prefilling, []
        b, self._batch = self._batch, None
        for req in group + (b.reqs if b is not None else []):
            self._finish(req, {"type": "abort", "message": message})

    def _abort_everything(self, message: str) -> None:
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        for req in pending:
            self._finish(req, {"type": "abort", "message": message})
        b = self._batch
        if b is not None:
            for r in b.reqs:
                self._finish(r, {"type": "abort", "message": message})
            self._batch = None

    def _fail_everything(self, message: str) -> None:
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
            commands = list(self._commands)
            self._commands.clear()
        b, self._batch = self._batch, None
        group, self._prefilling = self._prefilling, []
        for req in pending + group + (b.reqs if b is not None else []):
            if not req.future.done():
                self._finish(req, {"type": "abort", "message": message})
        for cmd in commands:
            if not cmd.future.done():
                cmd.future.set_exception(EngineError(message, status=503))

    # --- admission and prefill -------------------------------------------------------------------
    def _admit(self) -> None:
        running = self.num_running()
        if running >= self.max_running_requests:
            return
        if self._merge_ok is False and running > 0:
            return
        group: list[GenRequest] = []
        tokens = 0
        with self._lock:
            while self._pending and running + len(group) < self.max_running_requests:
                nxt = self._pending[0]
                if group and tokens + len(nxt.input_ids) > self.max_prefill_tokens:
                    break
                group.append(self._pending.popleft())
                tokens += len(nxt.input_ids)
        if not group:
            return
        # Requests that want nothing generated are answered without touching the model
        # (unless they asked for prompt log-probs).
        zero = [r for r in group if r.max_new == 0 and not (r.return_logprob and r.logprob_start_len >= 0)]
        for r in zero:
            self._finish(r, {"type": "length", "length": 0})
        group = [r for r in group if r not in zero]
        if group:
            self._prefilling = group
            self._prefill(group)
            self._prefilling = []

    def _prefill(self, group: list[GenRequest]) -> None:
        from transformers import DynamicCache

        bsz = len(group)
        maxlen = max(len(r.input_ids) for r in group)
        mask = torch.zeros((bsz, maxlen), dtype=torch.long)
        for i, r in enumerate(group):
            mask[i, maxlen - len(r.input_ids):] = 1
        cache = DynamicCache(config=self.model.config)
        # Shared-prompt prefill (prefix.py): identical prompts are prefilled once and their rows copied.
        src = prefix.plan(group) if self.share_prefill and _cache_layers_mergeable(cache) else None
        reps = prefix.first_rows(src) if src is not None else None
        rows = group if reps is None else [group[i] for i in reps]
        ids = torch.full((len(rows), maxlen), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, maxlen - len(r.input_ids):] = torch.tensor(r.input_ids, dtype=torch.long)
        row_mask = mask if reps is None else mask[reps]
        pos = (row_mask.cumsum(dim=1) - 1).clamp(min=0)
        want_prompt_lp = any(r.return_logprob and r.logprob_start_len >= 0 for r in group)
        with self._routes.recording(any(r.return_routed_experts for r in group)) as routes, self.lora.rows(rows):
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=row_mask.to(self.device),
                position_ids=pos.to(self.device),
                use_cache=True,
                logits_to_keep=0 if want_prompt_lp else 1,
                **{self._cache_kw: cache},
            )
            routes.take_prefill(group, maxlen, rows=src)
        logits = out.logits
        cache = self._out_cache(out)
        if self._merge_ok is None:
            self._merge_ok = _cache_layers_mergeable(cache)
            if not self._merge_ok:
                logger.warning("cache layers are not plain DynamicLayers: continuous batching disabled")
        self.stats["num_prompt_tokens"] += sum(len(r.input_ids) for r in group if r.log_metrics)
        if want_prompt_lp:
            prompt_logprobs(group, logits, maxlen, rows=src)
        last_logits = logits[:, -1, :]
        if src is not None:
            self.stats["num_cached_tokens"] += prefix.mark_cached(group, src)
            last_logits = prefix.expand(cache, last_logits, src)
        batch = _RunningBatch(
            reqs=list(group),
            cache=cache,
            mask=mask.to(self.device),
            pos=torch.tensor([len(r.input_ids) for r in group], dtype=torch.long, device=self.device),
            last=torch.zeros(bsz, dtype=torch.long, device=self.device),
        )
        # Requests that only wanted prompt log-probs are done now.
        only_prompt = [i for i, r in enumerate(group) if r.max_new == 0]
        for i in only_prompt:
            self._finish(group[i], {"type": "length", "length": 0})
        keep = [i for i in range(bsz) if i not in set(only_prompt)]
        if not keep:
            return
        if only_prompt:
            self._select_rows(batch, keep)
            last_logits = last_logits[keep]
        finished = self._sample_and_append(batch, last_logits)
        if finished:
            self._remove_rows_of(batch, finished)
        if len(batch) == 0:
            return
        self._merge(batch)

    # --- batch surgery ----------------------------------------------------------------------------
    def _select_rows(self, b: _RunningBatch, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        b.reqs = [b.reqs[i] for i in keep]
        b.mask = b.mask.index_select(0, idx)
        b.pos = b.pos.index_select(0, idx)
        b.last = b.last.index_select(0, idx)
        b.cache.batch_select_indices(idx)
        self._trim_left(b)

    def _remove_rows_of(self, b: _RunningBatch, drop: set[int]) -> None:
        keep = [i for i in range(len(b)) if i not in drop]
        if not keep:
            b.reqs = []
            return
        self._select_rows(b, keep)

    def _remove_rows(self, drop: set[int]) -> None:
        b = self._batch
        if b is None:
            return
        self._remove_rows_of(b, drop)
        if len(b) == 0:
            self._batch = None

    def _trim_left(self, b: _RunningBatch) -> None:
        if not self._merge_ok or b.mask.numel() == 0:
            return
        used = b.mask.sum(dim=0) > 0
        first = int(torch.nonzero(used)[0].item()) if bool(used.any()) else 0
        if first == 0:
            return
        b.mask = b.mask[:, first:]
        for layer in b.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]

    def _merge(self, new: _RunningBatch) -> None:
        old = self._batch
        if old is None or len(old) == 0:
            self._batch = new
            return
        from transformers import DynamicCache

        l_old, l_new = old.mask.shape[1], new.mask.shape[1]
        length = max(l_old, l_new)
        data = []
        for lo, ln in zip(old.cache.layers, new.cache.layers):
            k = torch.cat([_left_pad(lo.keys, 2, length - l_old), _left_pad(ln.keys, 2, length - l_new)], dim=0)
            v = torch.cat([_left_pad(lo.values, 2, length - l_old), _left_pad(ln.values, 2, length - l_new)], dim=0)
            data.append((k, v))
        cache = DynamicCache(ddp_cache_data=data)
        mask = torch.cat([_left_pad(old.mask, 1, length - l_old), _left_pad(new.mask, 1, length - l_new)], dim=0)
        self._batch = _RunningBatch(
            reqs=old.reqs + new.reqs,
            cache=cache,
            mask=mask,
            pos=torch.cat([old.pos, new.pos]),
            last=torch.cat([old.last, new.last]),
        )

    def _out_cache(self, out):
        cache = getattr(out, self._cache_kw, None)
        if cache is None:
            cache = getattr(out, "past_key_values", None) if self._cache_kw == "cache" else getattr(out, "cache", None)
        return cache

    # --- decoding ---------------------------------------------------------------------------------
    def _decode_step(self) -> None:
        b = self._batch
        assert b is not None
        bsz = len(b)
        b.mask = torch.cat([b.mask, torch.ones((bsz, 1), dtype=b.mask.dtype, device=b.mask.device)], dim=1)
        with self._routes.recording(any(r.return_routed_experts for r in b.reqs)) as routes, self.lora.rows(b.reqs):
            out = self.model(
                input_ids=b.last[:, None],
                attention_mask=b.mask,
                position_ids=b.pos[:, None],
                use_cache=True,
                **{self._cache_kw: b.cache},
            )
            routes.take_decode(b.reqs)
        b.cache = self._out_cache(out)
        b.pos = b.pos + 1
        self.stats["num_decode_steps"] += 1
        finished = self._sample_and_append(b, out.logits[:, -1, :])
        if finished:
            self._remove_rows(finished)

    def _sample_and_append(self, b: _RunningBatch, logits: torch.Tensor) -> set[int]:
        params = [r.params for r in b.reqs]
        suppress = [
            sorted(r.stop_ids) if len(r.output_ids) < r.params.min_new_tokens and r.stop_ids else []
            for r in b.reqs
        ]
        # A seeded request (sampling_seed) draws token k of its sequence from a generator seeded by
        # (seed, prompt length + k): independent of batching, of the other requests and of abort/resume.
        row_seeds = [
            None if r.params.sampling_seed is None
            else seeded_position_seed(r.params.sampling_seed, len(r.input_ids) + len(r.output_ids))
            for r in b.reqs
        ]
        row_gens = [r.generator for r in b.reqs]
        top_n = max((r.top_logprobs_num for r in b.reqs if r.return_logprob), default=0)
        res = sample_batch(
            logits,
            params,
            generator=self.generator,
            row_generators=row_gens if any(g is not None for g in row_gens) else None,
            row_seeds=row_seeds if any(x is not None for x in row_seeds) else None,
            suppress=suppress,
            top_logprobs_num=top_n,
        )
        toks = res.tokens.tolist()
        lps = res.logprobs.tolist()
        now = time.time()
        finished: set[int] = set()
        for i, r in enumerate(b.reqs):
            tok = toks[i]
            r.output_ids.append(tok)
            if r.first_token_time is None:
                r.first_token_time = now
            if r.return_logprob:
                r.output_logprobs.append(lps[i])
                if r.top_logprobs_num > 0 and res.top_ids is not None:
                    k = r.top_logprobs_num
                    r.output_top.append(list(zip(res.top_logprobs[i, :k].tolist(), res.top_ids[i, :k].tolist())))
            self.stats["num_generated_tokens"] += r.log_metrics
            reason = self._check_finish(r, tok)
            if reason is not None:
                self._finish(r, reason)
                finished.add(i)
        b.last = res.tokens.to(b.last.device)
        return finished

    def _check_finish(self, r: GenRequest, tok: int) -> dict | None:
        return check_finish(r, tok, self.tokenizer)

    # --- answers ----------------------------------------------------------------------------------
    def _finish(self, r: GenRequest, reason: dict) -> None:
        if r.future.done():
            return
        r.finish_reason = reason
        self.stats["num_requests_finished"] += r.log_metrics
        with self._lock:
            self._known_rids.discard(r.rid)
        try:
            resp = self._response(r)
        except BaseException as exc:  # pragma: no cover - decoding bug
            r.future.set_exception(exc)
            return
        r.future.set_result(resp)

    def _response(self, r: GenRequest) -> dict:
        return response_payload(r, self.tokenizer, self.weight_version)
