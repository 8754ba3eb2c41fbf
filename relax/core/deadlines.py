"""Deadlines of the run's calls, and the one console line that names a failed or overdue call.

Every call the controller makes into a role, and every request a role makes into an engine, the router, a
storage unit or a reward function, has a deadline taken from a documented flag:

    generate        --generate-timeout        one /generate request (tried 3 times in all)
    weight push     --weight-update-timeout   each request of a push to an engine (chunk, version check)
    control         --engine-control-timeout  engine memory release/resume and health checks, the driver's
                                              data-plane calls, each role's stop at shutdown
    reward          --reward-timeout          one reward call (a sample, or a group with --group-rm)
    trainer ranks   --train-step-timeout      a training step, log-probs, weight export and push, a save

A call past its deadline, or one that raised inside an actor, becomes a `RoleFailure` whose text is the one
line the console shows: who (role, rank, address), when (step), what it was doing, and the cause. The
traceback goes to the run's log file (`relax.core.run.run_controller`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_CAUSE_CHARS = 400  # a cause longer than this (e.g. a server log tail) is cut; the log file has it all


@dataclass(frozen=True)
class Deadlines:
    """Seconds allowed per kind of call, from the run's flags (None: no deadline)."""

    generate_s: float
    weight_update_s: float
    control_s: float
    reward_s: float | None
    train_s: float | None

    @classmethod
    def from_config(cls, config: Any) -> "Deadlines":
        def positive(value: Any) -> float | None:
            return float(value) if value is not None and float(value) > 0 else None

        return cls(generate_s=float(config.generate_timeout), weight_update_s=float(config.weight_update_timeout),
                   control_s=float(config.engine_control_timeout), reward_s=positive(config.reward_timeout),
                   train_s=positive(config.train_step_timeout))

    @property
    def shutdown_s(self) -> float:
        """What each role gets to stop by itself at shutdown before it is killed: the control deadline, capped
        so that a stopping run stays prompt even with a generous --engine-control-timeout."""
        return min(self.control_s, 10.0)


# The flag behind each kind of deadline, as the console line names it.
FLAGS = {"generate": "--generate-timeout", "weight_update": "--weight-update-timeout",
         "control": "--engine-control-timeout", "reward": "--reward-timeout", "train": "--train-step-timeout"}


@dataclass(frozen=True)
class Call:
    """One call into a role: who (role, rank, address), when (step) and what (action)."""

    role: str
    action: str
    rank: int | None = None
    address: str | None = None
    step: int | None = None

    def who(self) -> str:
        name = self.role if self.rank is None else f"{self.role} rank {self.rank}"
        return f"{name} ({self.address})" if self.address else name


def cause_text(exc: BaseException) -> str:
    """`Type: message` of the error that really happened: the cause a Ray task error carries, and only the
    first line of its message (the rest, e.g. a server log tail, is in the log file)."""
    cause = exc
    seen = 0
    while seen < 8:  # RayTaskError(RayTaskError(...)) when an error crossed several actors
        inner = getattr(cause, "cause", None)
        if not isinstance(inner, BaseException) or inner is cause:
            break
        cause, seen = inner, seen + 1
    if isinstance(cause, RoleFailure):
        return str(cause)
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if _looks_like_traceback(text) and len(lines) > 1:
        text = lines[-1]  # a text that is itself a traceback: its last line names the error
    if len(text) > MAX_CAUSE_CHARS:
        text = text[:MAX_CAUSE_CHARS] + " ..."
    name = type(cause).__name__
    if not text:
        return name
    return text if text.startswith(f"{name}:") else f"{name}: {text}"


def _looks_like_traceback(line: str) -> bool:
    return line.startswith(("Traceback (most recent call last)", "ray::")) or line.endswith(
        ("(most recent call last):",))


class RoleFailure(RuntimeError):
    """A call into a role failed (`cause`) or passed its deadline (`timeout_s`, `flag`); `str()` is the
    console line."""

    def __init__(self, call: Call, cause: BaseException | None = None, *, timeout_s: float | None = None,
                 flag: str | None = None, waiting: list[Call] | None = None):
        self.call = call
        self.cause_exc = cause
        self.timeout_s = timeout_s
        self.flag = flag
        self.waiting = list(waiting or [call])
        self.details: list[str] = []
        super().__init__(self._text())

    @property
    def timed_out(self) -> bool:
        return self.timeout_s is not None

    def add_detail(self, text: str) -> None:
        """Append what was found out after the failure (e.g. which engines no longer answer)."""
        if text:
            self.details.append(text)
            self.args = (self._text(),)

    def _text(self) -> str:
        who = ", ".join(c.who() for c in self.waiting)
        when = f"step {self.call.step}, " if self.call.step is not None else ""
        if self.timed_out:
            cause = f"no answer within {self.timeout_s:g} s ({self.flag})"
        else:
            cause = cause_text(self.cause_exc) if self.cause_exc is not None else "failed"
        return "; ".join([f"{who}, {when}{self.call.action}: {cause}", *self.details])


def console_line(exc: BaseException, log_path: Any = None) -> str:
    """The one line a failed run prints: a `RoleFailure` as it is, anything else as `Type: message`."""
    text = str(exc) if isinstance(exc, RoleFailure) else cause_text(exc)
    where = f" (traceback in {log_path})" if log_path else ""
    return f"run failed: {text}{where}"
