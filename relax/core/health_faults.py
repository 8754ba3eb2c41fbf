"""Test-only fault injection into Megatron ranks and the rollout manager: kill (SIGKILL) or hang (SIGSTOP) a chosen
rank of a chosen role, or the rollout manager, at a chosen step, while it runs a call of that step, so that the
HealthManager and the restarts (--use-health-check) are tested reproducibly. The pattern of
`relax.rollout.fault_injection` (engines).

Never active in a normal run: a fault is armed only by the environment variable RELAX_TEST_TRAINER_FAULT of the
driver (`relax-train`'s process; read once per run). The value is
`KIND:rank=I:step=N[:role=R][:call=M][:times=K][:delay=S]`, e.g. `kill:rank=1:step=2` or
`hang:rank=0:step=0:times=2`, or for the rollout manager (one actor: no rank) `KIND:role=rollout:step=N[...]`,
e.g. `hang:role=rollout:step=1`: KIND is `kill` or `hang`; R the role (`trainer`, the default, `reference`,
`teacher`, `critic`, `rollout`); M a part of the call's name (the trainer method, e.g. `train`, or the stage's
action, e.g. `log-probs`; the rollout manager's method and action, e.g. `generate`, `evaluate`; default: the
role's first call of step N); K how many attempts of the run it fires in
(default 1: only the first attempt; a restarted run then passes); S the seconds between the call going out and
the signal (default 0: the signal goes out as the call is sent, so that call, however short, is the one
that fails). The driver sends the signal to the rank's
process (its pid from the rank's heartbeats, or from the trainer's setup), so the rank must run on the
driver's node, as every rank of a one-machine run does. A fault of the rollout manager fires at the
controller's calls of the synchronous loop (`Controller._rollout_call`), not in --fully-async's rollout
thread.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

logger = logging.getLogger("relax")

ENV = "RELAX_TEST_TRAINER_FAULT"
SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}
ROLES = ("trainer", "reference", "teacher", "critic")  # Megatron roles: one process per rank
SINGLE_ROLES = ("rollout",)  # roles of one actor, without a rank (as their heartbeats and calls name them)
FORMAT = "KIND:rank=I:step=N[:role=R][:call=M][:times=K][:delay=S] (KIND:role=rollout:step=N[...] without rank)"


@dataclass
class RankFault:
    kind: str  # "kill" | "hang"
    rank: Optional[int]  # None: the rollout manager
    step: int
    role: str = "trainer"
    call: str = ""  # a part of the call's name; "" = any call of the step
    times: int = 1
    delay_s: float = 0.0
    fired: list = field(default_factory=list)  # one record per firing: {"attempt", "pid", "t"}

    @classmethod
    def parse(cls, text: str) -> "RankFault":
        kind, _, rest = text.strip().partition(":")
        if kind not in SIGNALS:
            raise ValueError(f"{ENV}: fault kind {kind!r} is not one of {sorted(SIGNALS)} (in {text!r})")
        fields = dict(part.split("=", 1) for part in rest.split(":") if part)
        unknown = set(fields) - {"rank", "step", "role", "call", "times", "delay"}
        role = fields.get("role", "trainer")
        single = role in SINGLE_ROLES
        if unknown or "step" not in fields or ("rank" in fields) == single:
            raise ValueError(f"{ENV}={text!r}: expected {FORMAT}")
        if role not in ROLES + SINGLE_ROLES:
            raise ValueError(f"{ENV}={text!r}: role {role!r} is not one of {list(ROLES + SINGLE_ROLES)}")
        return cls(kind, None if single else int(fields["rank"]), int(fields["step"]), role,
                   fields.get("call", ""), int(fields.get("times", 1)), float(fields.get("delay", 0.0)))

    @property
    def target(self) -> str:
        """The worker the fault hits, as the HealthManager names it."""
        return self.role if self.rank is None else f"{self.role} rank {self.rank}"

    def matches(self, role: str, action: str, step: Optional[int], attempt: int) -> bool:
        """Whether a call into `role` named `action` at `step`, in the run's attempt `attempt`, fires it."""
        fired_here = any(f["attempt"] == attempt for f in self.fired)
        return (role == self.role and step == self.step and self.call in action and not fired_here
                and len(self.fired) < self.times)

    def fire(self, pid: int, attempt: int) -> threading.Thread:
        """Send the fault's signal to `pid` after `delay_s`, from a thread (the caller goes on to wait)."""
        record = {"attempt": attempt, "pid": pid, "t": None}
        self.fired.append(record)

        def run() -> None:
            time.sleep(self.delay_s)
            try:
                os.kill(pid, SIGNALS[self.kind])
            except ProcessLookupError:
                logger.warning("test fault injection: %s (pid %d) is already gone", self.target, pid)
                return
            record["t"] = time.monotonic()
            logger.warning("test fault injection: %s %s (pid %d) at step %d", self.kind, self.target, pid, self.step)

        thread = threading.Thread(target=run, name="relax-test-rank-fault", daemon=True)
        thread.start()
        return thread

    def last_fired_at(self) -> Optional[float]:
        """Monotonic time of the latest signal sent (for the detection latency), None if none was."""
        times = [f["t"] for f in self.fired if f["t"] is not None]
        return times[-1] if times else None


def fault_from_env() -> Optional[RankFault]:
    text = os.environ.get(ENV)
    return RankFault.parse(text) if text else None
