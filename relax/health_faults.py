"""Test-only fault injection into Megatron ranks and the rollout manager: kill (SIGKILL) or hang (SIGSTOP) a chosen
rank of a chosen role, the rollout manager or the reward server, at a chosen step, while it runs a call of that step,
so that the HealthManager, the restarts (--use-health-check) and the reward server's watch (--use-fault-tolerance)
are tested reproducibly. The pattern of `relax.rollout.fault_injection` (engines).

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

The reward server (--rm-url, a process the user runs): `KIND:role=reward:step=N[:pid=P][:resume=S][:delay=S][:times=K]`,
e.g. `hang:role=reward:step=1:resume=4`, is fired by the rollout manager (which reads the same variable: it
reaches the manager when Relax starts Ray itself, as `relax-train` does; a test on a running Ray arms it with
`RewardServerWatch.faults`) as its first reward request of step N goes out, before it is sent: P is the server's
pid (default: the local process listening on --rm-url's port), S after `resume=` the seconds after which a hang
is ended (SIGCONT; default 0: never), K counts the run's attempts as above
(`relax.rollout.rewards.server_health`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

import psutil

logger = logging.getLogger("relax")

ENV = "RELAX_TEST_TRAINER_FAULT"
SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}
ROLES = ("trainer", "reference", "teacher", "critic")  # Megatron roles: one process per rank
# roles of one process, without a rank (as their heartbeats and calls name them); "reward" is the reward server
SINGLE_ROLES = ("rollout", "reward")
FORMAT = ("KIND:rank=I:step=N[:role=R][:call=M][:times=K][:delay=S] (KIND:role=rollout:step=N[...] without rank; "
          "KIND:role=reward:step=N[:pid=P][:resume=S][...] for the reward server)")


@dataclass
class RankFault:
    kind: str  # "kill" | "hang"
    rank: Optional[int]  # None: the rollout manager
    step: int
    role: str = "trainer"
    call: str = ""  # a part of the call's name; "" = any call of the step
    times: int = 1
    delay_s: float = 0.0
    resume_s: float = 0.0  # a hang ends (SIGCONT) this many seconds after its signal; 0: never
    pid: Optional[int] = None  # role=reward: the reward server's pid (default: the listener of --rm-url's port)
    fired: list = field(default_factory=list)  # one record per firing: {"attempt", "pid", "t"}

    @classmethod
    def parse(cls, text: str) -> "RankFault":
        kind, _, rest = text.strip().partition(":")
        if kind not in SIGNALS:
            raise ValueError(f"{ENV}: fault kind {kind!r} is not one of {sorted(SIGNALS)} (in {text!r})")
        fields = dict(part.split("=", 1) for part in rest.split(":") if part)
        unknown = set(fields) - {"rank", "step", "role", "call", "times", "delay", "resume", "pid"}
        role = fields.get("role", "trainer")
        single = role in SINGLE_ROLES
        if unknown or "step" not in fields or ("rank" in fields) == single:
            raise ValueError(f"{ENV}={text!r}: expected {FORMAT}")
        if role not in ROLES + SINGLE_ROLES:
            raise ValueError(f"{ENV}={text!r}: role {role!r} is not one of {list(ROLES + SINGLE_ROLES)}")
        if ("pid" in fields and role != "reward") or ("resume" in fields and kind != "hang"):
            raise ValueError(f"{ENV}={text!r}: pid= is for role=reward, resume= for a hang; expected {FORMAT}")
        return cls(kind, None if single else int(fields["rank"]), int(fields["step"]), role,
                   fields.get("call", ""), int(fields.get("times", 1)), float(fields.get("delay", 0.0)),
                   float(fields.get("resume", 0.0)), int(fields["pid"]) if "pid" in fields else None)

    @property
    def target(self) -> str:
        """The worker the fault hits, as the HealthManager names it."""
        if self.role == "reward":
            return "the reward server"
        return self.role if self.rank is None else f"{self.role} rank {self.rank}"

    def matches(self, role: str, action: str, step: Optional[int], attempt: int) -> bool:
        """Whether a call into `role` named `action` at `step`, in the run's attempt `attempt`, fires it."""
        fired_here = any(f["attempt"] == attempt for f in self.fired)
        return (role == self.role and step == self.step and self.call in action and not fired_here
                and len(self.fired) < self.times)

    def fire(self, pid: int, attempt: int, now: bool = False) -> threading.Thread:
        """Send the fault's signal to `pid` after `delay_s`, from a thread (the caller goes on to wait); with `now`
        and no delay, before returning (the caller's next request then meets the fault). A hang with `resume_s`
        is ended by SIGCONT that many seconds later."""
        record = {"attempt": attempt, "pid": pid, "t": None}
        self.fired.append(record)

        def signal_it() -> bool:
            try:
                os.kill(pid, SIGNALS[self.kind])
            except ProcessLookupError:
                logger.warning("test fault injection: %s (pid %d) is already gone", self.target, pid)
                return False
            record["t"] = time.monotonic()
            logger.warning("test fault injection: %s %s (pid %d) at step %d", self.kind, self.target, pid, self.step)
            return True

        inline = now and not self.delay_s and signal_it()

        def run() -> None:
            if not inline:
                time.sleep(self.delay_s)
                if not signal_it():
                    return
            if self.kind == "hang" and self.resume_s > 0:
                time.sleep(self.resume_s)
                try:
                    os.kill(pid, signal.SIGCONT)
                    record["resumed"] = time.monotonic()
                    logger.warning("test fault injection: %s (pid %d) resumed after %g s", self.target, pid,
                                   self.resume_s)
                except ProcessLookupError:
                    pass

        thread = threading.Thread(target=run, name="relax-test-rank-fault", daemon=True)
        thread.start()
        return thread

    def last_fired_at(self) -> Optional[float]:
        """Monotonic time of the latest signal sent (for the detection latency), None if none was."""
        times = [f["t"] for f in self.fired if f["t"] is not None]
        return times[-1] if times else None


def listener_pid(url: str) -> Optional[int]:
    """The pid of the local process listening on `url`'s port (the reward server a test started), None if none."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return conn.pid
    return None


def fault_from_env() -> Optional[RankFault]:
    text = os.environ.get(ENV)
    return RankFault.parse(text) if text else None
