"""Reward registry: ``get_reward_fn(rm_type)`` and per-sample ``rm_type`` resolution (``resolve_rm_type``, defined
with the other row checks in `relax.formats.row_checks`: the preflight runs it on every row).

A reward function is ``fn(response: str, label, metadata: dict) -> float | dict``;
it may be a coroutine function, or an object with an ``acall`` coroutine method
(used by the runner in preference to ``__call__``), like ``remote_rm``.

``boxed_<type>`` extracts the last ``\\boxed{...}`` of the response (nested braces
handled; the empty string when there is none) and scores it with ``<type>``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from relax.formats.row_checks import BOXED_PREFIX, resolve_rm_type
from relax.rollout.rewards import builtin
from relax.rollout.rewards.math_grader import extract_boxed
from relax.rollout.rewards.remote import RemoteRewardModel

__all__ = [
    "RewardFn",
    "register_reward",
    "get_reward_fn",
    "available_reward_types",
    "resolve_rm_type",
    "call_mode",
    "BOXED_PREFIX",
    "INLINE",
    "BATCHED",
    "PER_CALL",
]

RewardFn = Callable[[str, Any, dict], Any]

# name -> factory(**options) -> reward fn
_FACTORIES: dict[str, Callable[..., RewardFn]] = {}

# How the runner calls a reward (`call_mode`). Only the built-in synchronous functions registered below have a
# mode other than PER_CALL: a function registered by a user (or a built-in name overwritten by one) may block, hold
# a lock, or rely on running in parallel threads, so it keeps one executor call per sample with its own deadline.
INLINE = "inline"  # pure string work, linear in the response: called on the event loop, no thread hop
BATCHED = "batched"  # may be slow (sympy parsing, regex over long text): one thread hop per group, per-sample deadline
PER_CALL = "per_call"  # one executor call (or await) per sample
_MODES: dict[str, str] = {}


def register_reward(name: str, fn: Optional[RewardFn] = None, *, factory: bool = False, overwrite: bool = False):
    """Register a reward under ``name``.

    ``register_reward("x", fn)`` or as a decorator ``@register_reward("x")``. With
    ``factory=True`` the registered callable is called with ``get_reward_fn``'s options
    and must return the reward function.
    """
    if name.startswith(BOXED_PREFIX):
        raise ValueError(f"reward names may not start with {BOXED_PREFIX!r} (reserved prefix): {name!r}")

    def _register(f):
        if name in _FACTORIES and not overwrite:
            raise ValueError(f"reward type {name!r} is already registered")
        _FACTORIES[name] = f if factory else (lambda **_opts: f)
        _MODES.pop(name, None)  # a replaced built-in is the user's function now: called per sample
        return f

    return _register(fn) if fn is not None else _register


def available_reward_types() -> list[str]:
    return sorted(_FACTORIES)


def _is_async_capable(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "acall", None))


class _BoxedReward:
    """Extract the last boxed answer, then delegate to the inner reward."""

    def __init__(self, inner: RewardFn, inner_type: str) -> None:
        self.inner = inner
        self.inner_type = inner_type
        if _is_async_capable(inner):
            self.acall = self._acall  # only async-capable when the inner one is

    @staticmethod
    def _extract(response: str) -> str:
        boxed = extract_boxed(str(response))
        return "" if boxed is None else boxed

    def __call__(self, response: str, label: Any, metadata: Optional[dict] = None) -> Any:
        if inspect.iscoroutinefunction(self.inner):
            raise TypeError(f"boxed_{self.inner_type} wraps an async reward; use acall")
        return self.inner(self._extract(response), label, metadata if metadata is not None else {})

    async def _acall(self, response: str, label: Any, metadata: Optional[dict] = None) -> Any:
        md = metadata if metadata is not None else {}
        acall = getattr(self.inner, "acall", None)
        if acall is not None:
            return await acall(self._extract(response), label, md)
        return await self.inner(self._extract(response), label, md)

    def __repr__(self) -> str:
        return f"boxed({self.inner!r})"


def get_reward_fn(rm_type: str, **options: Any) -> RewardFn:
    """The reward function for ``rm_type``.

    Options go to factory-registered types; ``remote_rm`` takes ``rm_url`` (or ``url``),
    ``timeout``, ``max_retries``, ``backoff``, ``max_backoff``, ``headers``, ``payload_fn``.
    Unknown types raise ``ValueError`` listing the known ones.
    """
    if not rm_type or not isinstance(rm_type, str):
        raise ValueError(f"rm_type must be a non-empty string, got {rm_type!r}")
    if rm_type.startswith(BOXED_PREFIX):
        inner_type = rm_type[len(BOXED_PREFIX) :]
        return _BoxedReward(get_reward_fn(inner_type, **options), inner_type)
    factory = _FACTORIES.get(rm_type)
    if factory is None:
        raise ValueError(
            f"unknown reward type {rm_type!r}; known: {', '.join(available_reward_types())} "
            f"(and {BOXED_PREFIX}<type>), or pass a custom reward function path"
        )
    return factory(**options)


def call_mode(rm_type: str) -> str:
    """How the runner calls ``rm_type``'s function: INLINE, BATCHED or PER_CALL (see `_MODES`). ``boxed_<type>``
    adds a linear brace scan in front of ``<type>``, so it is called as ``<type>`` is."""
    if rm_type.startswith(BOXED_PREFIX):
        return call_mode(rm_type[len(BOXED_PREFIX):])
    return _MODES.get(rm_type, PER_CALL)


def _register_builtin(name: str, fn: RewardFn, mode: str) -> None:
    register_reward(name, fn)
    _MODES[name] = mode


def _remote_factory(
    rm_url: Optional[str] = None, url: Optional[str] = None, **kwargs: Any
) -> RemoteRewardModel:
    allowed = {"timeout", "max_retries", "backoff", "max_backoff", "headers", "payload_fn"}
    return RemoteRewardModel(rm_url or url, **{k: v for k, v in kwargs.items() if k in allowed})


_register_builtin("exact_match", builtin.exact_match_reward, INLINE)
_register_builtin("math", builtin.math_reward, BATCHED)
_register_builtin("dapo", builtin.dapo_reward, BATCHED)
_register_builtin("deepscaler", builtin.deepscaler_reward, BATCHED)
_register_builtin("f1", builtin.f1_reward, INLINE)
_register_builtin("gpqa", builtin.gpqa_reward, BATCHED)
_register_builtin("multiple_choice", builtin.multiple_choice_reward, BATCHED)
_register_builtin("random", builtin.random_reward, INLINE)
register_reward("remote_rm", _remote_factory, factory=True)
