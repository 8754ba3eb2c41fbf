"""Concurrent reward scoring with a documented failure policy.

A *sample* is any object (or mapping) with ``response`` (or ``response_text``, as
``relax.data.sample.Sample`` has), ``label`` and ``metadata`` fields. ``RewardRunner.ascore(samples)`` scores them concurrently on the running
event loop: async reward functions (coroutines, ``remote_rm``'s ``acall``) are
awaited, sync ones run in the runner's thread pool; at most ``max_concurrency``
calls are in flight.

What is called
  * a custom function (``custom_rm_path`` / ``custom_fn``): ``fn(args, sample)`` per
    sample, or with ``group_rm=True`` ``fn(args, group)`` once per group, returning one
    reward per sample of the group;
  * otherwise the built-in ``get_reward_fn(rm_type)`` per sample as
    ``fn(response, label, metadata)``, where ``metadata["rm_type"]`` overrides
    ``rm_type`` per sample (``group_rm`` does not change how built-ins are called);
  * reward type ``genrm``: the GenRM judge (``relax.rollout.rewards.genrm``): the runner's
    ``genrm``, else the rollout manager's (``active_judge``), per sample.

How built-ins are called
  A step of the embedded default scores 512 short answers; one executor call with its own ``wait_for`` per
  sample cost more CPU in the rollout manager than the rewards themselves. So built-in synchronous functions
  (`registry.call_mode`) are called as follows; custom, remote, GenRM and user-registered rewards keep one
  call per sample:
  * INLINE (``exact_match``, ``f1``, ``random`` and their ``boxed_`` forms): pure string work, linear in the
    response, called on the event loop. Their failures are counted and reported as any other.
  * BATCHED (``math``, ``dapo``, ``deepscaler``, ``gpqa``, ``multiple_choice``, boxed forms): one thread hop
    per prompt group, scoring its samples one after another; each sample still has ``timeout_s`` from the
    moment it starts (the first from when the group was submitted). A sample past it fails with the same
    ``TimeoutError``; the group's later samples are then scored one call each, as before.

Rewards
  A number, or a dict from which ``reward_key`` is taken (when ``reward_key`` is
  None: ``"reward"``, else ``"score"``). The reward must be a finite number;
  anything else is a failure.

Failure policy (``on_error``)
  * ``"fail"`` (default): the first failure raises ``RewardError`` naming the
    sample index (or the group and its sample range), the reward type and the
    original exception (chained as ``__cause__``); in-flight calls are cancelled.
  * ``"zero"``: the sample (every sample of a failed group call) gets 0.0, its
    ``metadata["reward_error"]`` is set to ``"ExcType: message"``, and it is
    counted in ``RewardResult.num_errors`` / ``error_indices`` and in the runner's
    cumulative ``stats()``. A warning is logged for each failure. Never silent:
    the trainer counts a step's failed rewards (``train/reward_failed_samples``)
    and stops the run when every one of them failed (``check_step_rewards``).

The reward server (--rm-type remote_rm, --rm-url) with --use-fault-tolerance
  Requests to it go through its watch (``server_watch``, `relax.rollout.rewards.server_health`): while the
  server does not answer its /health probe they are held and sent again once it does; a server gone for
  longer than --reward-timeout raises `RewardServerLost`, which stops the step whatever ``on_error`` says
  (a reward that could not be asked for is not a reward of 0.0).

Failures name the sample by its prompt group, place in the group, prompt row and
rollout step (``Sample.describe``); its global index is not assigned yet while
the step's rollout runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from relax.observability import timeline
from relax.rollout.rewards.custom import CustomReward, load_custom_reward
from relax.rollout.rewards.genrm import GENRM_TYPE, active_judge
from relax.rollout.rewards.registry import BATCHED, INLINE, PER_CALL, call_mode, get_reward_fn, resolve_rm_type
from relax.rollout.rewards.remote import RemoteRewardModel
from relax.rollout.rewards.server_health import RewardServerLost, RewardServerWatch, watch_from_args

__all__ = ["RewardRunner", "RewardResult", "RewardError", "AllRewardsFailedError", "check_step_rewards",
           "reward_name", "score_samples", "ascore_samples", "reward_to_float"]

logger = logging.getLogger(__name__)

ON_ERROR_POLICIES = ("fail", "zero")


class RewardError(RuntimeError):
    """A reward could not be computed (raised under ``on_error="fail"``)."""


class AllRewardsFailedError(RewardError):
    """Every reward of a step failed (each scored 0.0 under ``on_error="zero"``): the step holds nothing to
    learn from, so the run stops instead of training on it (`check_step_rewards`)."""


def reward_name(args: Any) -> str:
    """The run's reward as messages name it: the custom function's dotted path, or the built-in type (a
    reward server with its address)."""
    if args.custom_rm_path:
        return f"custom {args.custom_rm_path}"
    if args.rm_type == "remote_rm" and args.rm_url:
        return f"remote_rm at {args.rm_url}"
    return str(args.rm_type)


def check_step_rewards(samples: Sequence[Any], step: int, reward: str) -> int:
    """How many of a step's `samples` carry a failed reward (``metadata["reward_error"]``, scored 0.0 under
    --reward-error-policy zero). Raises `AllRewardsFailedError` when that is all of them: training on such a
    step would learn from the failures alone."""
    failed = [s for s in samples if _metadata(s).get("reward_error")]
    if samples and len(failed) == len(samples):
        raise AllRewardsFailedError(
            f"step {step}: every reward failed ({len(failed)} of {len(samples)} samples, reward {reward}; "
            f"--reward-error-policy zero scored them 0.0), so there is nothing to train on; first error: "
            f"{_metadata(failed[0])['reward_error']}")
    return len(failed)


@dataclass
class RewardResult:
    """Rewards aligned with the flattened input samples."""

    rewards: list[float]
    raw: list[Any]  # what the reward function returned (dict rewards kept), None for failures
    num_errors: int = 0
    error_indices: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def _field(sample: Any, name: str, default: Any = None) -> Any:
    if isinstance(sample, Mapping):
        return sample.get(name, default)
    return getattr(sample, name, default)


def _response(sample: Any) -> str:
    response = _field(sample, "response")
    if response is None:
        response = _field(sample, "response_text", "")
    return "" if response is None else str(response)


def _assign(sample: Any, reward: float, raw: Any) -> None:
    if isinstance(sample, Mapping):
        sample["reward"] = reward  # type: ignore[index]
        sample["raw_reward"] = raw  # type: ignore[index]
    else:
        sample.reward = reward
        sample.raw_reward = raw


def _metadata(sample: Any) -> dict:
    md = _field(sample, "metadata")
    return md if isinstance(md, dict) else {}


def _mark_error(sample: Any, message: str) -> None:
    md = _field(sample, "metadata")
    if isinstance(md, dict):
        md["reward_error"] = message
        return
    md = {"reward_error": message}
    try:
        if isinstance(sample, Mapping):
            sample["metadata"] = md  # type: ignore[index]
        else:
            setattr(sample, "metadata", md)
    except Exception:  # frozen object: the error is still counted and returned
        pass


def reward_to_float(value: Any, reward_key: Optional[str] = None) -> float:
    """A finite float from a reward function's result (see module doc)."""
    if isinstance(value, Mapping):
        if reward_key is not None:
            if reward_key not in value:
                raise KeyError(f"reward dict has no key {reward_key!r} (keys: {sorted(value)})")
            value = value[reward_key]
        elif "reward" in value:
            value = value["reward"]
        elif "score" in value:
            value = value["score"]
        else:
            raise KeyError(f"reward dict needs reward_key (keys: {sorted(value)})")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"reward must be a number, got {type(value).__name__}: {value!r}") from None
    if not math.isfinite(out):
        raise ValueError(f"reward is not finite: {out}")
    return out


def _group_index(sample: Any) -> int:
    value = _field(sample, "group_index")
    return value if isinstance(value, int) else -1


def sample_label(sample: Any, idx: int, place: Optional[int] = None) -> str:
    """How a failure names the sample: a rollout sample by its group, place, prompt row and step
    (`relax.data.sample.Sample.describe`); anything else by its position in the scored batch."""
    describe = getattr(sample, "describe", None)
    if callable(describe) and _group_index(sample) >= 0:
        return describe(place)
    return f"sample {idx}"


def group_label(group: Sequence[Any], g: int, start: int) -> str:
    first = group[0] if group else None
    if first is not None and _group_index(first) >= 0:
        row = _metadata(first).get("prompt_index")
        where = ([f"prompt row {row}"] if row is not None else []) + [f"step {_field(first, 'rollout_step', 0)}"]
        return f"group {first.group_index} ({len(group)} samples, {', '.join(where)})"
    return f"group {g} (samples {start}..{start + len(group) - 1})"


class _GroupHop:
    """One executor job scoring a group's samples in turn with built-in synchronous functions. The event loop
    reads which sample runs and since when (under `lock`) to enforce each sample's deadline, and sets `stopped`
    when one misses it or the scoring is cancelled: the worker then starts no further sample."""

    def __init__(self, calls: list[tuple[Any, str, Any, dict]]) -> None:
        self.calls = calls
        self.results: list[tuple[bool, Any]] = []  # (ok, raw reward or the exception), in order
        self.lock = threading.Lock()
        self.current = -1  # the sample being scored; -1 before the first
        self.started = 0.0  # time.monotonic() when `current` started
        self.stopped = False

    def run(self) -> None:
        for i, (fn, response, label, metadata) in enumerate(self.calls):
            with self.lock:
                if self.stopped:
                    return
                self.current, self.started = i, time.monotonic()
            try:
                out = (True, fn(response, label, metadata))
            except Exception as e:
                out = (False, e)
            self.results.append(out)


class RewardRunner:
    """Scores samples concurrently; see the module docstring for the contract.

    Use as a context manager (or call ``close()``) to shut the thread pool down.
    """

    def __init__(
        self,
        rm_type: Optional[str] = None,
        *,
        custom_rm_path: Optional[str] = None,
        custom_fn: Optional[Callable[..., Any]] = None,
        group_rm: bool = False,
        reward_key: Optional[str] = None,
        on_error: str = "fail",
        args: Any = None,
        max_workers: int = 8,
        max_concurrency: int = 256,
        rm_options: Optional[dict] = None,
        timeout_s: Optional[float] = None,
        server_watch: Optional[RewardServerWatch] = None,
    ) -> None:
        if on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"on_error must be one of {ON_ERROR_POLICIES}, got {on_error!r}")
        if custom_rm_path and custom_fn is not None:
            raise ValueError("pass custom_rm_path or custom_fn, not both")
        self.custom: Optional[CustomReward] = None
        if custom_rm_path:
            self.custom = load_custom_reward(custom_rm_path)
        elif custom_fn is not None:
            self.custom = custom_fn if isinstance(custom_fn, CustomReward) else CustomReward(custom_fn)
        if group_rm and self.custom is None:
            logger.info("group_rm without a custom reward function: built-ins are still scored per sample")
        self.rm_type = rm_type
        self.group_rm = bool(group_rm)
        self.reward_key = reward_key
        self.on_error = on_error
        self.args = args
        self.max_concurrency = int(max_concurrency)
        self.timeout_s = timeout_s  # per call (--reward-timeout); None waits forever
        self.rm_options = dict(rm_options or {})
        self.server_watch = server_watch  # the reward server's watch (--rm-url with --use-fault-tolerance)
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="relax-reward")
        self._fns: dict[str, Any] = {}
        self.genrm: Any = None  # relax.rollout.rewards.genrm.GenRMJudge; None: the process's active judge
        self._totals = {"num_samples": 0, "num_errors": 0, "num_calls": 0, "num_batches": 0}
        if self.custom is None and rm_type and rm_type != GENRM_TYPE:
            self._fn(rm_type)  # fail fast on an unknown type

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> "RewardRunner":
        """Build from an argparse-like namespace: ``rm_type``, ``custom_rm_path``, ``group_rm``,
        ``reward_key``, ``reward_error_policy``, ``reward_timeout``, ``rm_url``."""
        rm_options = {"rm_url": args.rm_url} if getattr(args, "rm_url", None) is not None else {}
        kw = dict(
            rm_type=getattr(args, "rm_type", None),
            custom_rm_path=getattr(args, "custom_rm_path", None),
            group_rm=bool(getattr(args, "group_rm", False)),
            reward_key=getattr(args, "reward_key", None),
            on_error=getattr(args, "reward_error_policy", None) or "fail",
            timeout_s=getattr(args, "reward_timeout", None),
            args=args,
            rm_options=rm_options,
        )
        kw.update(overrides)
        if "server_watch" not in kw and not kw["custom_rm_path"]:
            kw["server_watch"] = watch_from_args(args, kw["rm_type"])
        return cls(**kw)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict:
        """Cumulative counts over all batches scored by this runner."""
        return dict(self._totals)

    # ------------------------------------------------------------------ calling
    def _fn(self, rm_type: str) -> Any:
        fn = self._fns.get(rm_type)
        if fn is None:
            fn = get_reward_fn(rm_type, **self.rm_options)
            self._fns[rm_type] = fn
        return fn

    def _judge(self) -> Any:
        judge = self.genrm if self.genrm is not None else active_judge()
        if judge is None:
            raise RuntimeError("reward type genrm needs the GenRM engines: set --genrm-model-path")
        return judge

    async def _call_builtin(self, fn: Any, response: str, label: Any, metadata: dict) -> Any:
        acall = getattr(fn, "acall", None)
        if acall is not None and asyncio.iscoroutinefunction(acall):
            return await acall(response, label, metadata)
        if asyncio.iscoroutinefunction(fn):
            return await fn(response, label, metadata)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, response, label, metadata)

    def _watch_for(self, fn: Any, metadata: dict) -> Optional[RewardServerWatch]:
        """The reward server's watch for a request to it (not for a sample that names a server of its own)."""
        watch = self.server_watch
        inner = getattr(fn, "inner", fn)  # boxed_remote_rm wraps the remote model
        if watch is None or not isinstance(inner, RemoteRewardModel):
            return None
        return watch if inner._url_for(metadata) == watch.url else None

    def _timeout_error(self) -> TimeoutError:
        return TimeoutError(f"the reward call did not return within {self.timeout_s:g} s (--reward-timeout)")

    async def _deadline(self, call: Any) -> Any:
        """Await one reward call within `timeout_s`; past it the call is a failure that names the flag."""
        if self.timeout_s is None:
            return await call
        try:
            return await asyncio.wait_for(call, self.timeout_s)
        except asyncio.TimeoutError:
            raise self._timeout_error() from None

    def _route(self, sample: Any) -> tuple[str, str, Any]:
        """(mode, reward type, function) of a sample scored by a built-in (`registry.call_mode`). PER_CALL goes
        through `_score_one`: custom rewards, GenRM, async and user-registered functions, and a type that does
        not resolve (`_score_one` reports that failure as before)."""
        if self.custom is not None:
            return PER_CALL, "?", None
        try:
            rm_name = resolve_rm_type(self.rm_type, _metadata(sample))
            mode = PER_CALL if rm_name == GENRM_TYPE else call_mode(rm_name)
            return (mode, rm_name, None) if mode == PER_CALL else (mode, rm_name, self._fn(rm_name))
        except Exception:
            return PER_CALL, "?", None

    def _settle(self, idx: int, sample: Any, place: Optional[int], rm_name: str, ok: bool,
                value: Any) -> tuple[list[float], list[Any], list[int]]:
        """A built-in's outcome for one sample, failures counted and reported as `_score_one` does."""
        try:
            if not ok:
                raise value
            return [reward_to_float(value, self.reward_key)], [value], []
        except Exception as e:
            self._failure(sample_label(sample, idx, place), rm_name, e, [sample])
            return [0.0], [None], [idx]

    def _score_inline(self, idx: int, sample: Any, place: Optional[int], rm_name: str,
                      fn: Any) -> tuple[list[float], list[Any], list[int]]:
        try:
            out = (True, fn(_response(sample), _field(sample, "label"), _metadata(sample)))
        except Exception as e:
            out = (False, e)
        return self._settle(idx, sample, place, rm_name, *out)

    async def _await_hop(self, hop: _GroupHop, fut: asyncio.Future) -> Optional[int]:
        """Wait for a group's hop; the index of the sample that missed its deadline, or None when all ran."""
        if self.timeout_s is None:
            await fut
            return None
        submitted = time.monotonic()
        while True:
            with hop.lock:
                k, started = hop.current, hop.started
            remaining = (started if k >= 0 else submitted) + self.timeout_s - time.monotonic()
            if remaining <= 0:
                with hop.lock:
                    if hop.current == k:  # still on the same sample: it is past its deadline
                        hop.stopped = True
                        return max(k, 0)
                continue
            done, _ = await asyncio.wait({fut}, timeout=remaining)
            if done:
                fut.result()
                return None

    async def _score_batched(self, items: list[tuple[int, Any, Optional[int], str, Any]],
                             sem: asyncio.Semaphore) -> list[tuple[list[float], list[Any], list[int]]]:
        """A group's BATCHED samples, (idx, sample, place, type, fn) each, in one thread hop."""
        hop = _GroupHop([(fn, _response(s), _field(s, "label"), _metadata(s)) for _, s, _, _, fn in items])
        async with sem:
            fut = asyncio.get_running_loop().run_in_executor(self._executor, hop.run)
            try:
                late = await self._await_hop(hop, fut)
            except BaseException:
                with hop.lock:
                    hop.stopped = True
                raise
        parts = []
        for k, (idx, s, place, rm_name, _) in enumerate(items):
            if late is not None and k == late:
                parts.append(self._settle(idx, s, place, rm_name, False, self._timeout_error()))
            elif late is not None and k > late:  # never started in the hop: one call each, own deadlines
                parts.extend(await asyncio.gather(*(self._score_one(i, x, sem, p) for i, x, p, _, _ in items[k:])))
                break
            else:
                parts.append(self._settle(idx, s, place, rm_name, *hop.results[k]))
        return parts

    def _failure(
        self, where: str, rm_name: str, exc: BaseException, samples: Sequence[Any]
    ) -> str:
        message = f"{type(exc).__name__}: {exc}"
        if self.on_error == "fail":
            raise RewardError(f"reward failed for {where} (reward {rm_name}): {message}") from exc
        logger.warning("reward failed for %s (reward %s), scoring 0.0: %s", where, rm_name, message)
        for s in samples:
            _mark_error(s, message)
        return message

    async def _score_one(self, idx: int, sample: Any, sem: asyncio.Semaphore,
                         place: Optional[int] = None) -> tuple[list[float], list[Any], list[int]]:
        rm_name = "?"
        try:
            async with sem:
                if self.custom is not None:
                    rm_name = f"custom {self.custom.path}"
                    raw = await self._deadline(self.custom.acall(self.args, sample, executor=self._executor))
                else:
                    metadata = _metadata(sample)
                    rm_name = resolve_rm_type(self.rm_type, metadata)  # a reward server's errors name its URL
                    if rm_name == GENRM_TYPE:
                        raw = await self._deadline(self._judge().ajudge(sample))
                    else:
                        fn = self._fn(rm_name)

                        def request() -> Any:
                            return self._deadline(self._call_builtin(fn, _response(sample), _field(sample, "label"),
                                                                     metadata))

                        watch = self._watch_for(fn, metadata)
                        if watch is None:
                            raw = await request()
                        else:
                            step = _field(sample, "rollout_step")
                            raw = await watch.call(request, step if isinstance(step, int) else None)
            return [reward_to_float(raw, self.reward_key)], [raw], []
        except (asyncio.CancelledError, RewardServerLost):
            raise
        except Exception as e:
            self._failure(sample_label(sample, idx, place), rm_name, e, [sample])
            return [0.0], [None], [idx]

    async def _score_group(
        self, g: int, start: int, group: list[Any], sem: asyncio.Semaphore
    ) -> tuple[list[float], list[Any], list[int]]:
        assert self.custom is not None
        rm_name = f"custom {self.custom.path} (group)"
        try:
            async with sem:
                raw = await self._deadline(self.custom.acall(self.args, list(group), executor=self._executor))
            if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Sequence):
                raise TypeError(f"group reward must return a list of {len(group)} rewards, got {type(raw).__name__}")
            raw = list(raw)
            if len(raw) != len(group):
                raise ValueError(f"group reward returned {len(raw)} rewards for a group of {len(group)}")
            return [reward_to_float(r, self.reward_key) for r in raw], raw, []
        except asyncio.CancelledError:
            raise
        except Exception as e:
            where = group_label(group, g, start)
            self._failure(where, rm_name, e, group)
            return [0.0] * len(group), [None] * len(group), list(range(start, start + len(group)))

    @staticmethod
    def _groups(samples: Sequence[Any], group_size: Optional[int]) -> list[list[Any]]:
        if samples and all(isinstance(s, (list, tuple)) for s in samples):
            return [list(s) for s in samples]
        if group_size is None:
            return [[s] for s in samples]
        if group_size <= 0 or len(samples) % group_size:
            raise ValueError(f"{len(samples)} samples do not split into groups of {group_size}")
        return [list(samples[i : i + group_size]) for i in range(0, len(samples), group_size)]

    async def ascore(
        self, samples: Sequence[Any], *, group_size: Optional[int] = None, assign: bool = False
    ) -> RewardResult:
        """Score ``samples`` (flat, or a list of groups; or flat with ``group_size``).

        Returns rewards aligned with the flattened samples. With ``assign=True`` each
        sample's ``reward`` / ``raw_reward`` are set too (0.0 / None for failures).
        """
        groups = self._groups(samples, group_size)
        # --timeline-dump-dir: one span per call, i.e. per prompt group in a rollout (sglang_rollout scores each
        # group as it finishes), not per sample: 512 spans a step for the embedded default would drown the trace.
        first = groups[0][0] if groups and groups[0] else None
        step = _field(first, "rollout_step") if first is not None else None
        with timeline.lane_span("reward", "reward", step=step if isinstance(step, int) else None, cat="reward",
                                reward=self._label(), samples=sum(len(g) for g in groups)) as span_args:
            result = await self._ascore(groups, assign)
            span_args["errors"] = result.num_errors
        return result

    def _label(self) -> str:
        """The reward as a timeline span names it."""
        if self.custom is not None:
            return f"custom {self.custom.path}"
        return str(self.rm_type)

    async def _ascore(self, groups: list[list[Any]], assign: bool) -> RewardResult:
        t0 = time.perf_counter()
        sem = asyncio.Semaphore(self.max_concurrency)
        coros = []
        covers: list[list[int]] = []  # per coroutine, the places in `placed` order of the parts it returns
        placed: list[tuple[int, Any]] = []  # (order, parts) of what was scored inline
        start = 0
        try:
            if self.group_rm and self.custom is not None:
                for g, group in enumerate(groups):
                    covers.append([g])
                    coros.append(self._score_group(g, start, group, sem))
                    start += len(group)
            else:
                for group in groups:
                    batch = []
                    for place, s in enumerate(group):
                        mode, rm_name, fn = self._route(s)
                        if mode == INLINE:
                            placed.append((start, self._score_inline(start, s, place, rm_name, fn)))
                        elif mode == BATCHED:
                            batch.append((start, s, place, rm_name, fn))
                        else:
                            covers.append([start])
                            coros.append(self._score_one(start, s, sem, place))
                        start += 1
                    if batch:
                        covers.append([item[0] for item in batch])
                        coros.append(self._score_batched(batch, sem))
        except BaseException:  # an inline failure under on_error="fail": nothing was scheduled yet
            for c in coros:
                c.close()
            raise
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            done = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        for where, out in zip(covers, done):
            placed.extend(zip(where, out if isinstance(out, list) else [out]))
        # inline and batched samples were scored out of turn: back to the samples' order
        placed.sort(key=lambda item: item[0])
        parts = [part for _, part in placed]
        rewards: list[float] = []
        raw: list[Any] = []
        errors: list[int] = []
        for r, w, e in parts:
            rewards.extend(r)
            raw.extend(w)
            errors.extend(e)
        if assign:
            flat = [s for group in groups for s in group]
            for s, r, w in zip(flat, rewards, raw):
                _assign(s, r, w)
        stats = {
            "num_samples": len(rewards),
            "num_groups": len(groups),
            "num_calls": start if not (self.group_rm and self.custom is not None) else len(coros),
            "num_errors": len(errors),
            "error_indices": list(errors),
            "elapsed_s": time.perf_counter() - t0,
        }
        self._totals["num_samples"] += len(rewards)
        self._totals["num_errors"] += len(errors)
        self._totals["num_calls"] += stats["num_calls"]
        self._totals["num_batches"] += 1
        return RewardResult(rewards=rewards, raw=raw, num_errors=len(errors), error_indices=errors, stats=stats)

    def score(
        self, samples: Sequence[Any], *, group_size: Optional[int] = None, assign: bool = False
    ) -> RewardResult:
        """Blocking ``ascore`` (not from inside a running event loop: use ``await ascore``)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.ascore(samples, group_size=group_size, assign=assign))
        raise RuntimeError("RewardRunner.score() called inside a running event loop; use 'await runner.ascore(...)'")


async def ascore_samples(
    samples: Sequence[Any],
    rm_type: Optional[str] = None,
    *,
    group_size: Optional[int] = None,
    assign: bool = False,
    **kwargs: Any,
) -> RewardResult:
    """One-shot ``RewardRunner(rm_type, **kwargs).ascore(samples)``."""
    runner = RewardRunner(rm_type, **kwargs)
    try:
        return await runner.ascore(samples, group_size=group_size, assign=assign)
    finally:
        runner.close()


def score_samples(
    samples: Sequence[Any],
    rm_type: Optional[str] = None,
    *,
    group_size: Optional[int] = None,
    assign: bool = False,
    **kwargs: Any,
) -> RewardResult:
    """One-shot blocking ``RewardRunner(rm_type, **kwargs).score(samples)``."""
    with RewardRunner(rm_type, **kwargs) as runner:
        return runner.score(samples, group_size=group_size, assign=assign)
