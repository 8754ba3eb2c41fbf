"""A child process forked from a rank that has imported torch and Megatron but computed nothing yet, with the
part of `subprocess.Popen` its owner uses (`pid`, `wait`, `kill`).

Why fork: a fresh interpreter (`python -m ...`) imports torch and Megatron again. Measured at warm embedded-default
starts (2 cores, where start-up is bound by the CPU of every process starting at once): the reference process took
3.8-4.1 CPU s as a fresh interpreter, 1.5-1.7 s forked (its model build and passes), and the rank ~0.3 s more (the
fork and its copy-on-write faults).

When fork is safe here, and why the owner decides:
  * no OpenMP thread team may exist in the parent: a child of a process whose GNU OpenMP ran a parallel region on
    several threads hangs at its own first parallel region (measured with torch 2.13: a 2000x2000 matmul on 2
    threads, fork, the same matmul in the child never returns). Ops on one thread make no team. A trainer rank
    forks in its constructor, before its model is built; a test process may have run anything, so it spawns.
  * no process group may exist in the parent: the child makes a one-rank group of its own.
  * the child runs only `target` and leaves with `os._exit`: it must not run the parent's exit handlers (Ray's
    among them) nor touch the parent's Ray connection, whose threads do not exist in the child.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Callable


class ForkedChild:
    """`target()` in a forked child; the parent's ends of its pipes (`close_in_child`) are closed there first, so
    that the child sees the end of its input when the parent goes."""

    def __init__(self, target: Callable[[], None], close_in_child: tuple[int, ...] = ()):
        sys.stdout.flush()  # what the parent buffered would be written twice
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                for fd in close_in_child:
                    os.close(fd)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handlers stop the parent's run
                signal.signal(signal.SIGINT, signal.default_int_handler)
                target()
                code = 0
            except BaseException:  # noqa: BLE001 - printed, then the exit code says it failed
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N for signal N, as Popen's
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            if self.returncode is None:
                self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
