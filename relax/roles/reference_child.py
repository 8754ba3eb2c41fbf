"""The child side of relax.roles.reference_process: `python -m relax.roles.reference_child READ_FD WRITE_FD`
builds the reference model in a one-rank gloo group of its own and answers the parent's requests until the
parent's end of the pipe closes."""

from __future__ import annotations

import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from relax import heap
from relax.backends.megatron.cpu_compat import apply_cpu_compat
from relax.backends.megatron.model import weights_checksum
from relax.backends.megatron.parallel import free_port, init_distributed
from relax.roles.reference_process import receive, send
from relax.roles.megatron_settings import build_reference_trainer


def _build(config: Any, threads: int):
    torch.set_num_threads(max(1, threads))  # the rank's own count: the same kernels, so the same rows
    apply_cpu_compat()
    # a rendezvous of its own: the reference has the actor's one-rank layout
    init_distributed(0, 1, "127.0.0.1", free_port(), backend="gloo",
                     timeout_minutes=config.distributed_timeout_minutes)
    return build_reference_trainer(config)[0]


def _answer(reference, message: tuple) -> Any:
    kind = message[0]
    if kind == "logprobs":
        tokens, lengths, response_lengths, temperature = message[1:]
        inputs = [{"tokens": t, "response_length": n} for t, n in zip(torch.split(tokens, lengths), response_lengths)]
        start = time.perf_counter()
        rows = reference.compute_logprobs(inputs, temperature) if inputs else []
        end = time.perf_counter()
        packed = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.float32)
        return packed, [len(r) for r in rows], start, end
    if kind == "checksum":
        return weights_checksum(reference.gpt_model)
    raise ValueError(f"unknown request {kind!r}")


def serve(conn_in: Connection, conn_out: Connection) -> None:
    reference = None
    while True:
        try:
            message = receive(conn_in)
        except EOFError:  # the rank ended (or was killed): nothing more to do
            return
        try:
            if message[0] == "setup":
                reference, answer = _build(*message[1:]), None
                heap.freeze()  # the model lives as long as the process (relax.heap)
            elif reference is None:
                raise RuntimeError("the reference model was not built (its build failed above)")
            else:
                answer = _answer(reference, message)
        except Exception:  # noqa: BLE001 - sent back whole; the parent raises it in the stage that asked
            reply: tuple = ("error", traceback.format_exc())
        else:
            reply = ("ok", answer)
        try:
            send(conn_out, reply)
        except OSError:  # the rank ended while this request ran: nobody to answer
            return


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
