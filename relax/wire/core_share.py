"""Idle cores handed to the fully-async trainer on a CPU node.

Each compute process of a CPU node runs a fixed number of torch threads (relax.config.env.threads_per_process:
the node's cores less one, shared out), because OpenMP threads that share a core with a busy neighbour wait on
each other. In a fully-async run (--max-staleness >= 1) the trainer and the rollout engines compute at the same
time, but not all the time: the rollout of step N+1 mostly ends well before step N's update does, and the
engines' core then sits idle until the next weight push (likewise the reference's, between its passes). The
trainer takes such cores back while they are idle:

* the roles beside it (the rollout manager for its engines; the reference, teacher and critic ranks, whose
  passes run beside the trainer's) write on a board how many cores they compute on at the moment
  (`CoreBoard.computing`), and 0 when they stop;
* the trainer's model calls `ElasticThreads.apply` at every transformer layer of its forward and backward
  passes, which sets the trainer's torch threads to the node's cores less the busy ones, and never below its
  own share.

The board is one small file in shared memory per run and node (`relax-cores-TOKEN`, one byte per slot, each
writer its own slot): processes of other nodes open a board of their own and do not see this node's, which is
right, since they do not share its cores. Reads and writes are a system call each (microseconds), so the check
at every layer costs nothing measurable. A writer that dies while it computes leaves its slot set: the trainer
then keeps to its own share, the safe side.

Only in fully-async runs with --max-staleness >= 1 on CPU, of a model wide enough that a second thread pays
(`Config.shares_idle_cores`, relax.config.facts: measured gains and losses there): --max-staleness 0 is the
synchronous schedule, which must give the synchronous loop's numbers exactly, and a thread count changing with
the timing changes float32 round-off in reductions, so such runs are not bitwise reproducible (learning is the
same within the noise). RELAX_SHARE_IDLE_CORES=0 keeps the fixed counts; =1 shares at any width.
"""

from __future__ import annotations

import os
import time
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from relax.config.env import shm_dir

CORES_META = "core_board"  # config.meta key: the run's board token (set by the controller when cores are shared)
PREFIX = "relax-cores-"
SLOTS = 64
ROLLOUT_SLOT = 0  # the rollout manager, for its engines
RANK_SLOTS = {"reference": 1, "teacher": 22, "critic": 43}  # + the rank (up to 21 ranks of a role per node)


def new_token() -> str:
    return uuid.uuid4().hex[:16]


def board_path(token: str, directory: str | None = None) -> str:
    return os.path.join(directory or shm_dir(), f"{PREFIX}{token}")


def remove_board(token: str) -> None:
    try:
        os.unlink(board_path(token))
    except FileNotFoundError:
        pass


def node_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and Ray may narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class CoreBoard:
    """The board of one run on this node: `SLOTS` bytes, byte i = the cores writer i computes on now."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self._fd).st_size < SLOTS:  # the first to open it sizes it; the others keep its bytes
            os.ftruncate(self._fd, SLOTS)

    @classmethod
    def for_run(cls, token: Optional[str]) -> Optional["CoreBoard"]:
        return cls(board_path(token)) if token else None

    def set(self, slot: int, cores: int) -> None:
        os.pwrite(self._fd, bytes([max(0, min(255, int(cores)))]), slot)

    def busy_cores(self) -> int:
        return sum(os.pread(self._fd, SLOTS, 0))

    @contextmanager
    def computing(self, slot: int, cores: int) -> Iterator[None]:
        """Marks `cores` busy in `slot` for the block's duration."""
        self.set(slot, cores)
        try:
            yield
        finally:
            self.set(slot, 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ElasticThreads:
    """The trainer's thread count: `node - busy` (busy: the board's cores in use), between `own` and `node`.

    `set_threads` is torch.set_num_threads in the trainer; it is called only when the count changes. `mean()`
    is the time-weighted mean count since the last `reset()`, reported with each update."""

    def __init__(self, board: CoreBoard, own: int, node: int, set_threads: Callable[[int], None],
                 clock: Callable[[], float] = time.perf_counter):
        self.board, self.own, self.node = board, max(1, own), max(1, node)
        self._set, self._clock = set_threads, clock
        self.current = self.own
        self._since = clock()
        self._weighted = 0.0
        self._elapsed = 0.0

    def wanted(self) -> int:
        return max(self.own, self.node - self.board.busy_cores())

    def apply(self) -> int:
        n = self.wanted()
        if n != self.current:
            self._account()
            self._set(n)
            self.current = n
        return n

    def _account(self) -> None:
        now = self._clock()
        self._weighted += self.current * (now - self._since)
        self._elapsed += now - self._since
        self._since = now

    def mean(self) -> float:
        self._account()
        return self._weighted / self._elapsed if self._elapsed > 0 else float(self.current)

    def reset(self) -> None:
        self._account()
        self._weighted = self._elapsed = 0.0
