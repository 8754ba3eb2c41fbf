"""Megatron-LM's run control in Relax's synchronous loop (relax.core.controller `_loop`).

- `--iterations-to-skip N [N ...]`: Megatron's iterations are 1-indexed, so rollout step S (0-indexed, as
  metrics.jsonl counts them) is iteration S + 1. A skipped step is rolled out (its prompts are consumed, as
  Megatron's skipped iteration consumes its batch) but no training stage runs: no update, no reference or critic
  pass, the optimizer step count and LR schedule do not advance. The step's record says
  `train/skipped_iteration: 1`, and the weights are pushed on schedule as usual (unchanged by this step).
- `--exit-duration-in-mins M`: at the end of the first step that ends more than M minutes after the run's
  controller was created (Megatron counts from its own start too), save a checkpoint when --save is set (unless
  that step was just saved) and stop; the run exits 0.
- `--exit-signal-handler` (with `--exit-signal`, default SIGTERM): the signal no longer stops the run at once;
  the current step finishes, a checkpoint is saved when --save is set, and the run exits 0. A second such signal
  stops at once, as without the flag.

Both stops log one line saying why, after which step, and where the checkpoint is.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from relax.config.rules_checkpoint import signal_name

logger = logging.getLogger("relax")

# output dir -> when the first attempt's controller was created: a run restarted by --use-health-check
# (relax.core.health_restart builds a new controller per attempt) keeps counting from the first one.
_RUN_STARTS: dict[str, float] = {}


def signal_of(value: Any) -> signal.Signals:
    """--exit-signal's value (a name, or the enum Megatron's own parser gives) as a signal."""
    return signal.Signals[signal_name(value)]


class RunControl:
    def __init__(self, config: Any, attempt: int = 0, clock: Callable[[], float] = time.time):
        self.clock = clock
        key = str(Path(config.output_dir).resolve())
        if attempt == 0 or key not in _RUN_STARTS:
            _RUN_STARTS[key] = clock()
        self.started = _RUN_STARTS[key]
        minutes = config.get("exit_duration_in_mins")
        self.minutes = minutes
        self.limit_s = minutes * 60.0 if minutes else None
        self.skip = frozenset(int(i) for i in (config.get("iterations_to_skip") or ()))
        self.exit_signal = signal_of(config.get("exit_signal") or "SIGTERM") if config.get("exit_signal_handler") \
            else None
        self.received: Optional[str] = None
        self.stopped: Optional[str] = None  # why the loop stopped before --num-rollout, once it has

    def skips(self, step: int) -> bool:
        """Whether rollout step `step` (0-indexed) is one of --iterations-to-skip (1-indexed)."""
        return step + 1 in self.skip

    def stop_reason(self) -> Optional[str]:
        """Why the loop should stop after the step that just ended, or None."""
        if self.received:
            return f"{self.received} received (--exit-signal-handler)"
        if self.limit_s is not None:
            elapsed = self.clock() - self.started
            if elapsed > self.limit_s:
                return f"--exit-duration-in-mins {self.minutes}: {elapsed / 60:.1f} min since the run started"
        return None

    @contextlib.contextmanager
    def signal_handler(self) -> Iterator[None]:
        """--exit-signal-handler: while the loop runs, --exit-signal is noted (the step goes on) instead of
        stopping the run; a second one goes to the handler it replaced (relax.core.run: stop at once)."""
        if self.exit_signal is None:
            yield
            return
        if threading.current_thread() is not threading.main_thread():  # Python sets handlers there only
            logger.warning("--exit-signal-handler: the loop does not run in the main thread; %s is not handled",
                           self.exit_signal.name)
            yield
            return
        previous = signal.getsignal(self.exit_signal)

        def note(signum: int, frame: Any) -> None:
            if self.received and callable(previous):
                previous(signum, frame)
                return
            self.received = signal.Signals(signum).name
            logger.warning("%s received: the run saves a checkpoint and stops after the current step "
                           "(--exit-signal-handler); send it again to stop at once", self.received)

        signal.signal(self.exit_signal, note)
        try:
            yield
        finally:
            signal.signal(self.exit_signal, previous)

    def stop_line(self, reason: str, steps_done: int, num_rollout: int, saved: Optional[Path]) -> str:
        where = (f"checkpoint {steps_done} saved in {saved.parent} (resume with --load {saved.parent})"
                 if saved is not None else "no checkpoint saved (no --save)")
        return f"stopping after step {steps_done - 1} ({steps_done} of {num_rollout} steps done): {reason}; {where}"
