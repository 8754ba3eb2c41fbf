"""Test-only fault injection into rollout engines: kill (SIGKILL) or hang (SIGSTOP) a chosen engine at a
chosen rollout step, while it holds requests, so that fault tolerance is tested reproducibly.

Never active in a normal run: a fault is armed only by the environment variable RELAX_TEST_ENGINE_FAULT
(read once by the rollout manager; it reaches the manager when Relax starts Ray itself, as `relax-train`
does) or by a test calling `RolloutManager.inject_engine_fault` on the manager actor. The value is
`KIND:engine=I:step=N`, e.g. `kill:engine=1:step=1` or `hang:engine=0:step=0`: KIND is `kill` or
`hang`, I the engine's place in the pool's list (start order), N the rollout step. At that step's
generation the fault fires as soon as the engine reports a request in flight (`EngineClient.num_requests`),
or after `wait=S` seconds (default 30) if it never does. `KIND:router:step=N` (e.g. `kill:router:step=1`) signals the
rollout router instead, once the first engine holds a request.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from relax.wire.engine_client import EngineClient

logger = logging.getLogger(__name__)

ENV = "RELAX_TEST_ENGINE_FAULT"
SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}


@dataclass(frozen=True)
class EngineFault:
    kind: str  # "kill" | "hang"
    engine: int  # place in the pool's list of engines (the one watched for a request in flight, for the router)
    step: int
    wait_s: float = 30.0
    router: bool = False  # the rollout router is signalled, not the engine

    @classmethod
    def parse(cls, text: str) -> "EngineFault":
        kind, _, rest = text.strip().partition(":")
        if kind not in SIGNALS:
            raise ValueError(f"{ENV}: fault kind {kind!r} is not one of {sorted(SIGNALS)} (in {text!r})")
        parts = [part for part in rest.split(":") if part]
        router = "router" in parts
        fields = dict(part.split("=", 1) for part in parts if part != "router")
        unknown = set(fields) - {"engine", "step", "wait"}
        stray = [part for part in parts if "=" not in part and part != "router"]
        if unknown or stray or ("engine" not in fields and not router) or "step" not in fields:
            raise ValueError(f"{ENV}={text!r}: expected KIND:engine=I:step=N[:wait=S] or KIND:router:step=N")
        return cls(kind, int(fields.get("engine", 0)), int(fields["step"]), float(fields.get("wait", 30.0)), router)


def fault_from_env() -> Optional[EngineFault]:
    text = os.environ.get(ENV)
    return EngineFault.parse(text) if text else None


def arm(fault: EngineFault, url: str, send_signal: Callable[[int], None],
        on_fired: Callable[[dict[str, Any]], None]) -> threading.Thread:
    """Fire `fault` (through `send_signal(sig)`) once engine `url` holds a request, from a thread."""

    def busy() -> bool:
        client = EngineClient(url, timeout_s=2.0)
        try:
            return client.num_requests() > 0
        except Exception:
            return False
        finally:
            client.close()

    def run() -> None:
        deadline = time.monotonic() + fault.wait_s
        held = busy()
        while not held and time.monotonic() < deadline:
            time.sleep(0.02)
            held = busy()
        send_signal(SIGNALS[fault.kind])
        logger.warning("test fault injection: %s %s at step %d", fault.kind,
                       "the router" if fault.router else f"engine {url}", fault.step)
        # in_flight: the engine held requests when the signal went out, so the fault hit work in progress
        on_fired({"fault": fault.kind, "url": url, "step": fault.step, "in_flight": held})

    thread = threading.Thread(target=run, name="relax-test-engine-fault", daemon=True)
    thread.start()
    return thread
