"""The in-trainer reference model (relax.roles.megatron_settings.reference_in_trainer) of a one-rank actor, in a child
process of that rank: its pass runs beside the actor's forward pass on the other core.

Why a process and not a thread: both passes are a few hundred small kernels with Python between each, so two
threads of one process take turns on the GIL. Measured on the embedded default (2 cores, one thread each): the
reference and the old-log-prob pass took ~0.19 s one after the other, ~0.18 s on two threads, ~0.11 s alone.
The child runs the same code as the rank would (same model build, seed, thread count and micro-batches), so its
rows are bitwise those of a pass in the rank itself.

Protocol: two pipes given to `python -m relax.roles.reference_child READ_FD WRITE_FD`, carrying pickled
messages (`send`, `receive`: plain pickle over `multiprocessing.connection.Connection`'s framing; its own
`send` would pickle tensors as shared-memory handles, which the child cannot open without multiprocessing's
authentication key). The parent sends (config, threads) once, then requests
("logprobs", tokens, lengths, response_lengths, temperature) or ("checksum",); the child answers ("ok", value)
or ("error", traceback text). The child exits when the parent's end closes (the rank ended or was killed)."""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

import torch


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class ReferenceProcessError(RuntimeError):
    """The reference process failed: its build, a pass, or the process itself."""


class ReferenceProcess:
    """Parent side. `start` a pass, then `result` it; one pass in flight at a time. The child builds the reference
    model while the rank goes on starting (its first request waits for the build)."""

    _BUILD = "the reference model's build"

    def __init__(self, config: Any, threads: int, timeout_s: float | None = None):
        child_read, parent_write = os.pipe()
        parent_read, child_write = os.pipe()
        self._timeout_s = timeout_s  # --train-step-timeout per request (None: no deadline)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "relax.roles.reference_child", str(child_read), str(child_write)],
            pass_fds=(child_read, child_write), close_fds=True)
        os.close(child_read)
        os.close(child_write)
        self._send_conn = Connection(parent_write, readable=False)
        self._recv_conn = Connection(parent_read, writable=False)
        self._pending: str | None = None  # what the request in flight asked, for its error lines
        self._request(("setup", config, threads), self._BUILD)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def start(self, sequences: list[list[int]], response_lengths: list[int], temperature: float) -> None:
        """Start the reference log-probs of the responses: sequence i is prompt + response token ids, its last
        response_lengths[i] tokens the response. Sent packed (one tensor): 512 tensors of a few tokens each cost
        more to build and pickle than the pass's own Python work."""
        lengths = [len(seq) for seq in sequences]
        tokens = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.long)
        self._request(("logprobs", tokens, lengths, list(response_lengths), temperature),
                      f"the reference log-probs of {len(sequences)} samples")

    def result(self) -> tuple[list[torch.Tensor], float, float]:
        """(one float32 row per sample, the pass's start and end on `time.perf_counter`'s clock)."""
        packed, response_lengths, start, end = self._answer()
        return list(torch.split(packed, response_lengths)), start, end

    def compute_logprobs(self, inputs: list[dict[str, Any]], temperature: float) -> list[torch.Tensor]:
        """`MegatronTrainer.compute_logprobs`'s call: {"tokens": LongTensor, "response_length": int} each."""
        self.start([x["tokens"].tolist() for x in inputs], [int(x["response_length"]) for x in inputs], temperature)
        return self.result()[0]

    def weights_checksum(self) -> float:
        """Sum of |w| over the reference's parameters (as `MegatronRank.weights_checksum`)."""
        self._request(("checksum",), "the reference weights' checksum")
        return self._answer()

    def close(self) -> int:
        """Close the pipes (the child exits once its request in flight, if any, is done); the child's exit code."""
        for conn in (self._send_conn, self._recv_conn):
            conn.close()
        try:
            return self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()

    def _request(self, message: tuple, what: str) -> None:
        if self._pending == self._BUILD:  # the build's answer first (it only says whether the model is there)
            self._answer()
        elif self._pending is not None:
            raise ReferenceProcessError(f"reference process: {what} asked while {self._pending} is unanswered")
        self._pending = what
        try:
            send(self._send_conn, message)
        except OSError:  # BrokenPipeError: the child is gone
            raise self._died(what) from None

    def _answer(self) -> Any:
        what, self._pending = self._pending, None
        if not self._recv_conn.poll(self._timeout_s):
            raise ReferenceProcessError(f"reference process pid {self.pid}: no answer within {self._timeout_s:g} s "
                                        f"for {what} (--train-step-timeout)")
        try:
            status, value = receive(self._recv_conn)
        except (EOFError, OSError):
            raise self._died(what) from None
        if status != "ok":
            raise ReferenceProcessError(f"reference process pid {self.pid} failed in {what}:\n{value}")
        return value

    def _died(self, what: str | None = None) -> ReferenceProcessError:
        code = self._proc.wait()
        return ReferenceProcessError(
            f"reference process pid {self.pid} exited with code {code}" + (f" during {what}" if what else "")
            + "; its own output is in this rank's log above")
