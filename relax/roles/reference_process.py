"""The in-trainer reference model of a one-rank actor (config.reference_placement "child_process" / "streamed",
relax.config.facts), in a child process of that rank: its pass runs beside the actor's forward pass on the other core.

Why a process and not a thread: both passes are a few hundred small kernels with Python between each, so two
threads of one process take turns on the GIL. Measured on the embedded default (2 cores, one thread each): the
reference and the old-log-prob pass took ~0.19 s one after the other, ~0.18 s on two threads, ~0.11 s alone.
The child runs the same code as the rank would (same model build, seed, thread count and micro-batches), so its
rows are bitwise those of a pass in the rank itself.

The policy too (`with_policy`): with several optimizer steps per rollout, the old-policy log-probs of the samples
of the second and later updates are needed only when those updates start. The child keeps a forward-only copy of
the actor's model; each step the rank writes its weights (the rollout policy's, before the first update) into a
shared-memory segment the child copies from, and asks for the passes in parts (`Part`): the reference rows of the
first update's samples, then the old and reference rows of each later update's. The rank trains the first update
while the child computes the rest on the other core (relax.roles.step_passes).

Protocol: two pipes given to `python -m relax.roles.reference_child READ_FD WRITE_FD` (or to the same code in a
child forked from the rank: relax.roles.forked_child), carrying pickled
messages (`send`, `receive`: plain pickle over `multiprocessing.connection.Connection`'s framing; its own
`send` would pickle tensors as shared-memory handles, which the child cannot open without multiprocessing's
authentication key). The parent sends ("setup", config, threads, with_policy) once, then requests
("logprobs", tokens, lengths, response_lengths, temperature, parts, policy) or ("checksum",); the child answers
("ok", value) or ("error", traceback text), once per part of a "logprobs" request (an error ends the request). The
child exits when the parent's end closes (the rank ended or was killed)."""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Sequence

import torch

from relax.roles.forked_child import ForkedChild
from relax.weights.shm import ShmSegment, dtype_name

REFERENCE = "ref"  # a part's rows: the reference model's log-probs
POLICY = "old"  # the policy copy's (the old-policy log-probs), with `with_policy`


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class ReferenceProcessError(RuntimeError):
    """The reference process failed: its build, a pass, or the process itself."""


@dataclass
class Part:
    """One answered part of a pass: the `kind` rows (REFERENCE or POLICY) of samples [lo, hi), one float32 row per
    sample, and when the child computed them (`time.perf_counter`'s clock, which the child shares)."""

    kind: str
    lo: int
    hi: int
    rows: list[torch.Tensor]
    start: float
    end: float


def policy_layout(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, str, tuple, int]], int]:
    """(entries (name, dtype, shape, byte offset), bytes) of `named` packed one after another, 64-byte aligned."""
    entries, offset = [], 0
    for name, tensor in named:
        entries.append((name, dtype_name(tensor.dtype), tuple(tensor.shape), offset))
        offset += (tensor.numel() * tensor.element_size() + 63) // 64 * 64
    return entries, offset


def segment_views(buf: torch.Tensor, entries: Sequence[tuple[str, str, tuple, int]]) -> list[torch.Tensor]:
    """Views of the uint8 segment `buf` as the tensors `entries` describe (no copies)."""
    views = []
    for _, dtype, shape, offset in entries:
        dt = getattr(torch, dtype)
        numel = 1
        for d in shape:
            numel *= d
        size = numel * torch.empty((), dtype=dt).element_size()
        views.append(buf[offset:offset + size].view(dt).view(shape))
    return views


class ReferenceProcess:
    """Parent side. `start` a pass, then `result` it; one pass in flight at a time. The child builds the reference
    model while the rank goes on starting (its first request waits for the build)."""

    _BUILD = "the reference model's build"

    def __init__(self, config: Any, threads: int, timeout_s: float | None = None, with_policy: bool = False,
                 fork: bool = False):
        """`fork`: fork the child from this process instead of starting a fresh interpreter; only where no
        OpenMP thread team and no process group exist yet (relax.roles.forked_child says why)."""
        child_read, parent_write = os.pipe()
        parent_read, child_write = os.pipe()
        self._timeout_s = timeout_s  # --train-step-timeout per request (None: no deadline)
        if fork and not torch.distributed.is_initialized():
            def serve_pipes() -> None:
                from relax.roles.reference_child import serve
                serve(Connection(child_read, writable=False), Connection(child_write, readable=False))

            self._proc: Any = ForkedChild(serve_pipes, close_in_child=(parent_read, parent_write))
        else:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "relax.roles.reference_child", str(child_read), str(child_write)],
                pass_fds=(child_read, child_write), close_fds=True)
        os.close(child_read)
        os.close(child_write)
        self._send_conn = Connection(parent_write, readable=False)
        self._recv_conn = Connection(parent_read, writable=False)
        self._pending: str | None = None  # what the request in flight asked, for its error lines
        self._parts_left = 0  # parts of the pass in flight not received yet
        self.with_policy = with_policy
        self._segment: ShmSegment | None = None  # the policy weights the child copies from (`with_policy`)
        self._layout: tuple | None = None  # (path, bytes, entries) of the segment, sent with each pass
        self._request(("setup", config, threads, with_policy), self._BUILD)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def start(self, sequences: list[list[int]], response_lengths: list[int], temperature: float,
              parts: Sequence[tuple[str, int, int]] | None = None,
              policy: Sequence[tuple[str, torch.Tensor]] | None = None) -> None:
        """Start the log-probs of the responses: sequence i is prompt + response token ids, its last
        response_lengths[i] tokens the response. Sent packed (one tensor): 512 tensors of a few tokens each cost
        more to build and pickle than the pass's own Python work. `parts`: (kind, lo, hi) in the order they are
        computed and answered (default: the reference rows of every sample, one part); POLICY parts run the
        child's policy copy with the weights `policy` ((name, tensor) as the model's state dict; needed with
        them, written into the shared segment before the request goes)."""
        lengths = [len(seq) for seq in sequences]
        parts = [(REFERENCE, 0, len(sequences))] if parts is None else [tuple(p) for p in parts]
        kinds = sorted({"the reference" if k == REFERENCE else "the old-policy" for k, _, _ in parts})
        what = f"{' and '.join(kinds)} log-probs of {len(sequences)} samples"
        if self._parts_left or self._pending not in (None, self._BUILD):  # the child may be reading the segment
            raise ReferenceProcessError(f"reference process: {what} asked while {self._pending} is unanswered")
        layout = None
        if any(kind == POLICY for kind, _, _ in parts):
            if not self.with_policy or policy is None:
                raise ReferenceProcessError("reference process: old-policy rows asked without the policy's "
                                            "weights (with_policy and `policy`)")
            layout = self._write_policy(policy)
        tokens = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.long)
        self._request(("logprobs", tokens, lengths, list(response_lengths), temperature, parts, layout), what)
        self._parts_left = len(parts)

    def next_part(self) -> Part:
        """The next part of the pass in flight, in the order `start` asked them (an error ends the pass)."""
        if self._parts_left <= 0:
            raise ReferenceProcessError("reference process: no pass in flight")
        self._parts_left -= 1
        kind, lo, hi, packed, response_lengths, start, end = self._answer(keep_pending=self._parts_left > 0)
        return Part(kind, lo, hi, list(torch.split(packed, response_lengths)), start, end)

    def result(self) -> tuple[list[torch.Tensor], float, float]:
        """The rows of a one-part pass (`start` without `parts`): (one float32 row per sample, the pass's start and
        end on `time.perf_counter`'s clock)."""
        part = self.next_part()
        return part.rows, part.start, part.end

    def drain(self) -> None:
        """Receive and drop what is left of the pass in flight (a stage failed before it read them), errors
        included, so that the next request's answers are its own."""
        while self._parts_left > 0:
            try:
                self.next_part()
            except ReferenceProcessError:
                return

    def _write_policy(self, policy: Sequence[tuple[str, torch.Tensor]]) -> tuple:
        """Copy `policy` into the shared segment (made, or remade when the model's tensors change); its layout."""
        entries, nbytes = policy_layout(policy)
        if self._segment is None or self._layout is None or self._layout[2] != entries:
            if self._segment is not None:
                self._segment.close()
            self._segment = ShmSegment(nbytes)
            self._layout = (self._segment.path, self._segment.nbytes, entries)
        with torch.no_grad():
            for view, (_, tensor) in zip(segment_views(self._segment.buf, entries), policy):
                view.copy_(tensor.detach())
        return self._layout

    def compute_logprobs(self, inputs: list[dict[str, Any]], temperature: float) -> list[torch.Tensor]:
        """`MegatronTrainer.compute_logprobs`'s call: {"tokens": LongTensor, "response_length": int} each."""
        self.start([x["tokens"].tolist() for x in inputs], [int(x["response_length"]) for x in inputs], temperature)
        return self.result()[0]

    def weights_checksum(self) -> float:
        """Sum of |w| over the reference's parameters (as `MegatronRank.weights_checksum`)."""
        self._request(("checksum",), "the reference weights' checksum")
        return self._answer()

    def close(self) -> int:
        """Close the pipes (the child exits once its request in flight, if any, is done) and remove the policy's
        segment; the child's exit code."""
        for conn in (self._send_conn, self._recv_conn):
            conn.close()
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        try:
            return self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()

    def _request(self, message: tuple, what: str) -> None:
        if self._pending == self._BUILD:  # the build's answer first (it only says whether the model is there)
            self._answer()
        elif self._pending is not None or self._parts_left:
            raise ReferenceProcessError(f"reference process: {what} asked while {self._pending} is unanswered")
        self._pending = what
        try:
            send(self._send_conn, message)
        except OSError:  # BrokenPipeError: the child is gone
            raise self._died(what) from None

    def _answer(self, keep_pending: bool = False) -> Any:
        what = self._pending
        self._pending = what if keep_pending else None
        if not self._recv_conn.poll(self._timeout_s):
            self._pending, self._parts_left = None, 0
            raise ReferenceProcessError(f"reference process pid {self.pid}: no answer within {self._timeout_s:g} s "
                                        f"for {what} (--train-step-timeout)")
        try:
            status, value = receive(self._recv_conn)
        except (EOFError, OSError):
            self._pending, self._parts_left = None, 0
            raise self._died(what) from None
        if status != "ok":
            self._pending, self._parts_left = None, 0
            raise ReferenceProcessError(f"reference process pid {self.pid} failed in {what}:\n{value}")
        return value

    def _died(self, what: str | None = None) -> ReferenceProcessError:
        code = self._proc.wait()
        return ReferenceProcessError(
            f"reference process pid {self.pid} exited with code {code}" + (f" during {what}" if what else "")
            + "; its own output is in this rank's log above")
