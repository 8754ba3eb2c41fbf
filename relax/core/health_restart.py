"""The restart ladder of --use-health-check: a failed attempt of the run is torn down and the run started again
from its last checkpoint, at most --max-global-restart times; then the run stops with one line naming what
failed and how often.

Scope, smallest first: a dead or hung rollout engine never gets here with --use-fault-tolerance (the engine
pool replaces it in place). A failed Megatron rank (trainer, reference, teacher or critic: killed, hung past
--heartbeat-timeout or raising) in a synchronous run with a checkpoint to resume from restarts those roles
alone (`Controller.restart_megatron_roles`): the rollout manager, its engines and router and the data plane
stay, and get the checkpoint's rollout position and weights. Any other failure (the rollout manager, the data
plane, a fully-async or colocated run, no checkpoint yet, or a failed restart of the Megatron roles) restarts
every role, keeping Ray itself: a global restart. Both count against --max-global-restart. A run whose first
start-up fails is not restarted (a broken configuration or model would fail every time), nor one whose cause
is outside the run (`NOT_RESTARTED`: a reward server that stays down).

Nothing is lost or duplicated: the restarted attempt resumes from the newest checkpoint under --save (else the
run's --load, else step 0, as the log says), which holds the trainer, the saved auxiliary roles and the rollout
position (data source and sample counter). Steps after that checkpoint are done again from the same prompts
with the same sample ids; their records are taken out of metrics.jsonl (kept in restarts.jsonl) before the
restarted attempt writes them again, and the run's sample accounting is rebuilt from the records that remain,
so every step and every trained sample id appears once for the model state that survives.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from relax.formats.checkpoint_layout import latest_iteration
from relax.config.config import Config
from relax.core.deadlines import Call, RoleFailure
from relax.core.health import MEGATRON_ROLES, new_board_name
from relax.observability.accounting import PREFIX as ACCOUNTING_PREFIX
from relax.observability.accounting import RunAccounting
from relax.observability.heartbeat import BOARD_META
from relax.observability.notify import Notifier

if TYPE_CHECKING:  # the controller imports this module
    from relax.core.controller import Controller

logger = logging.getLogger("relax")
trace_log = logging.getLogger("relax.trace")  # tracebacks: the run's log file only
ATTEMPT_META = "health_attempt"  # config.meta key: which attempt of the run this config starts (0: the first)


def attempt_config(config: Config, attempt: int, load: Optional[str], board: Optional[str] = None) -> Config:
    """The config of attempt `attempt`: resuming from `load`, with a heartbeat board of its own (`board`: the
    one a restart of the Megatron roles alone keeps)."""
    values = config.to_dict()
    if attempt > 0:  # the restarted attempt resumes where the checkpoint stands, not at --start-rollout-id
        values["load"], values["start_rollout_id"] = load, None
    meta = {**config.meta, BOARD_META: board or new_board_name(), ATTEMPT_META: attempt}
    return Config(values, config.explicit, meta, config.derived)


# Failures no restart can help, by the name of the error a role raised: what is lost is outside the run.
NOT_RESTARTED = {
    "RewardServerLost": "the reward server is not a role of this run, and a restart cannot bring it back",
}


def restart_cannot_help(exc: BaseException) -> Optional[str]:
    """Why restarting the run cannot help with `exc` (None when it can)."""
    text = str(exc)
    return next((why for name, why in NOT_RESTARTED.items() if name in text), None)


def megatron_roles_alone(controller: Controller, who: str, load: Optional[str]) -> bool:
    """Whether a restart of the Megatron roles alone can handle the failure of `who` (see the module docstring)."""
    c = controller.config
    return (who.split(" rank ")[0] in MEGATRON_ROLES and load is not None and controller.started
            and not (c.fully_async or c.colocate or c.debug_rollout_only or c.debug_train_only))


def resume_point(config: Any) -> tuple[Optional[str], Optional[int]]:
    """(save root, iteration) of the newest complete checkpoint a restart resumes from: --save's, else --load's;
    (None, None) when there is none (the restart starts from step 0)."""
    for root in (config.save, config.load):
        if root and Path(root).exists():
            it = latest_iteration(root)
            if it is not None:
                return str(root), it
    return None, None


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def truncate_metrics(path: Path, step: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Keep the records of steps before `step` in metrics.jsonl (rewritten atomically); returns (kept,
    discarded). The restarted attempt writes the later steps again."""
    records = read_records(path)
    kept = [r for r in records if r.get("step", -1) < step]
    discarded = [r for r in records if r.get("step", -1) >= step]
    if discarded:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, path)
    return kept, discarded


def step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of training steps (those with sample accounting), to rebuild the run's totals."""
    return [r for r in records if any(k.startswith(ACCOUNTING_PREFIX) for k in r)]


def failed_who(exc: BaseException) -> str:
    """Which role (and rank) a failure names, as the restart count groups them."""
    if isinstance(exc, RoleFailure):
        call = exc.call
        return call.role if call.rank is None else f"{call.role} rank {call.rank}"
    return type(exc).__name__


class RestartLedger:
    """How many restarts were made, and how often each role (rank) failed."""

    def __init__(self, max_restarts: int):
        self.max_restarts = max(0, int(max_restarts))
        self.restarts = 0
        self.failures: Counter = Counter()

    def record(self, exc: BaseException, who: Optional[str] = None) -> str:
        who = who or failed_who(exc)
        self.failures[who] += 1
        return who

    @property
    def exhausted(self) -> bool:
        return self.restarts >= self.max_restarts

    def give_up(self, exc: BaseException) -> RoleFailure:
        """The run's final failure: the last one, with how often each role failed and the restarts made."""
        failure = exc if isinstance(exc, RoleFailure) else RoleFailure(Call("run", "training"), exc)
        counts = ", ".join(f"{who} failed {n} time{'s' if n > 1 else ''}" for who, n in self.failures.items())
        failure.add_detail(f"gave up after {self.restarts} restart{'s' if self.restarts != 1 else ''} "
                           f"(--max-global-restart {self.max_restarts}): {counts}")
        return failure


class Restarts:
    """The driver's restart loop state across the run's attempts (used by relax.core.run.run_controller)."""

    def __init__(self, config: Any):
        self.config = config
        self.ledger = RestartLedger(config.max_global_restart)
        self.out = Path(config.output_dir)
        self.failed_at: Optional[float] = None  # monotonic time of the last failure, for the restart time
        self.resumed_step: Optional[int] = None
        self.last_who: Optional[str] = None  # the role (rank) the last failure is counted against

    def should_restart(self, controller: Controller, exc: BaseException) -> bool:
        """Count the failure; True to restart, False when the run's first start-up failed. Raises the final
        failure once --max-global-restart restarts were made."""
        self.failed_at = time.monotonic()
        if controller.attempt == 0 and not controller.started:
            return False
        why = restart_cannot_help(exc)
        if why:  # the run stops at once, with the failure's own line
            logger.warning("health: not restarting: %s", why)
            return False
        who = None
        if controller.health is not None and isinstance(exc, RoleFailure) and exc.timed_out:
            for call in exc.waiting:  # past its deadline: alive and stuck in the call, or silent (stopped, dead)
                if call.rank is not None:
                    exc.add_detail(controller.health.describe(call.role, call.rank))
        lost = controller.health.lost_ranks() if controller.health is not None else []
        if lost:  # the rank whose process died or stopped, rather than a peer whose collective failed with it
            who = lost[0][0]
            if isinstance(exc, RoleFailure) and failed_who(exc) != who:
                exc.add_detail(f"{who}: {lost[0][1]}")
        who = self.ledger.record(exc, who)
        self.last_who = who
        fault = controller.ctx.fault
        fired = fault.last_fired_at() if fault is not None else None
        if fired is not None:
            logger.warning("health: %s failure detected %.2f s after the injected fault", who,
                           self.failed_at - fired)
        if self.ledger.exhausted:
            raise self.ledger.give_up(exc) from exc
        return True

    def restart(self, controller: Controller, make: Callable[[Config], Any], exc: BaseException) -> Any:
        """Tear `controller` down (Ray stays), then build the next attempt's controller resuming from the newest
        checkpoint; metrics.jsonl keeps the steps before it."""
        self.ledger.restarts += 1
        n = self.ledger.restarts
        # a warning, not an error: the run goes on, and a later failure's notification names its own first error
        logger.warning("health: %s; restart %d of %d (--max-global-restart)", exc, n, self.ledger.max_restarts)
        who = self.last_who or failed_who(exc)
        load, iteration = resume_point(self.config)
        step = iteration if iteration is not None else 0
        alone = megatron_roles_alone(controller, who, load)
        if not alone:
            controller.shutdown(keep_ray=True)
        if load is None:
            logger.warning("health: no checkpoint under --save or --load: restarting from step 0 (add --save and "
                           "--save-interval to resume from a checkpoint)")
        else:
            logger.info("health: resuming from the checkpoint at step %d under %s", step, load)
        kept, discarded = truncate_metrics(self.out / "metrics.jsonl", step)
        if discarded:
            logger.info("health: metrics.jsonl keeps steps before %d; %d record(s) of steps %s are done again",
                        step, len(discarded), sorted({r.get("step") for r in discarded}))
        scope = "megatron roles" if alone else "every role"
        with (self.out / "restarts.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps({"restart": n, "failed": str(exc), "who": who, "scope": scope, "resume_from": load,
                                "resume_step": step, "discarded_records": discarded, "time": time.time()}) + "\n")
        detail = f"{who} failed ({exc}); restart {n} of {self.ledger.max_restarts} ({scope}) from step {step}"
        Notifier.from_config(self.config).restarted(detail)
        self.resumed_step = step
        if alone:
            logger.info("health: restarting the Megatron roles alone (the rollout manager, engines and data plane "
                        "stay) from the checkpoint at step %d", step)
            try:
                controller.restart_megatron_roles(attempt_config(self.config, n, load,
                                                                 board=controller.config.meta.get(BOARD_META)),
                                                  load, controller.ctx.current_step)
                controller.ctx.accounting = RunAccounting()
                for record in step_records(kept):  # the run's sample accounting: the steps that survive
                    controller.ctx.accounting.add(record)
                return controller
            except Exception as failure:  # the next rung: every role
                logger.warning("health: restarting the Megatron roles alone failed (%s); restarting every role",
                               failure)
                trace_log.warning("restart of the Megatron roles", exc_info=True)
                controller.shutdown(keep_ray=True)
        nxt = make(attempt_config(self.config, n, load), earlier_children=controller._earlier_children)
        nxt.started_ray = controller.started_ray  # the first attempt's Ray: the last attempt's shutdown stops it
        nxt.ctx.fault = controller.ctx.fault
        for record in step_records(kept):  # the run's sample accounting: the steps that survive
            nxt.ctx.accounting.add(record)
        return nxt

    def started(self, controller: Controller) -> None:
        """Log how long the restart took once the restarted attempt's roles are up (and resumed)."""
        if controller.attempt > 0 and self.failed_at is not None:
            logger.info("health: restart %d: every role is back at step %d, %.1f s after the failure",
                        controller.attempt, controller.start_step, time.monotonic() - self.failed_at)
