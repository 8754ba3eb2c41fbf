"""The child side of relax.roles.reference_process: `python -m relax.roles.reference_child READ_FD WRITE_FD`
builds the reference model (and with `with_policy` a forward-only copy of the actor's model, whose weights each
pass copies from the parent's shared segment) in a one-rank gloo group of its own and answers the parent's
requests until the parent's end of the pipe closes."""

from __future__ import annotations

import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Iterator

import torch

from relax import heap
from relax.formats.model_arch import arch_for_run
from relax.backends.megatron.cpu_compat import apply_cpu_compat
from relax.backends.megatron.hf_weights import unwrap_model
from relax.backends.megatron.model import weights_checksum
from relax.backends.megatron.parallel import free_port, init_distributed
from relax.backends.megatron.trainer import MegatronTrainer
from relax.roles.megatron_settings import build_reference_trainer, trainer_settings
from relax.roles.reference_process import POLICY, REFERENCE, receive, segment_views, send


class Models:
    """The child's models: the reference, and with `with_policy` the policy copy with its segment's views."""

    def __init__(self, config: Any, threads: int, with_policy: bool):
        torch.set_num_threads(max(1, threads))  # the rank's own count: the same kernels, so the same rows
        apply_cpu_compat()
        # a rendezvous of its own: the reference has the actor's one-rank layout
        init_distributed(0, 1, "127.0.0.1", free_port(), backend="gloo",
                         timeout_minutes=config.distributed_timeout_minutes)
        self.reference = build_reference_trainer(config)[0]
        # the policy's weights come from the rank at every pass: built, not loaded
        self.policy = MegatronTrainer(arch_for_run(config), trainer_settings(config, forward_only=True)) \
            if with_policy else None
        self._segment: tuple[str, torch.Tensor] | None = None  # (path, the mapped segment)

    def load_policy(self, layout: tuple) -> None:
        """Copy the weights the rank wrote into the segment of `layout` (path, bytes, entries) into the policy."""
        if self.policy is None:
            raise RuntimeError("old-policy rows asked of a reference process started without the policy")
        path, nbytes, entries = layout
        if self._segment is None or self._segment[0] != path:
            self._segment = (path, torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8))
        state = unwrap_model(self.policy.model).state_dict(keep_vars=True)
        missing = [name for name, *_ in entries if name not in state]
        if missing:
            raise RuntimeError(f"the rank's weights name tensors the policy copy lacks: {missing[:5]}")
        with torch.no_grad():
            for (name, *_), view in zip(entries, segment_views(self._segment[1], entries)):
                state[name].copy_(view)


def _parts(models: Models, message: tuple) -> Iterator[tuple]:
    """The answers of a "logprobs" request, one per part, each as soon as it is computed."""
    tokens, lengths, response_lengths, temperature, parts, layout = message[1:]
    if layout is not None:
        models.load_policy(layout)
    inputs = [{"tokens": t, "response_length": n} for t, n in zip(torch.split(tokens, lengths), response_lengths)]
    for kind, lo, hi in parts:
        model = models.reference if kind == REFERENCE else models.policy if kind == POLICY else None
        if model is None:
            raise ValueError(f"unknown rows {kind!r}")
        start = time.perf_counter()
        rows = model.compute_logprobs(inputs[lo:hi], temperature) if hi > lo else []
        end = time.perf_counter()
        packed = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.float32)
        yield kind, lo, hi, packed, [len(r) for r in rows], start, end


def _answers(models: Models | None, message: tuple) -> Iterator[Any]:
    if models is None:
        raise RuntimeError("the reference model was not built (its build failed above)")
    kind = message[0]
    if kind == "logprobs":
        yield from _parts(models, message)
    elif kind == "checksum":
        yield weights_checksum(models.reference.gpt_model)
    else:
        raise ValueError(f"unknown request {kind!r}")


def _reply(conn: Connection, reply: tuple) -> bool:
    try:
        send(conn, reply)
        return True
    except OSError:  # the rank ended while this request ran: nobody to answer
        return False


def serve(conn_in: Connection, conn_out: Connection) -> None:
    models = None
    while True:
        try:
            message = receive(conn_in)
        except EOFError:  # the rank ended (or was killed): nothing more to do
            return
        try:
            if message[0] == "setup":
                models = Models(*message[1:])
                heap.freeze()  # the models live as long as the process (relax.heap)
                replies: Any = [None]
            else:
                replies = _answers(models, message)
            for answer in replies:  # a "logprobs" request's parts, each sent once computed
                if not _reply(conn_out, ("ok", answer)):
                    return
        except Exception:  # noqa: BLE001 - sent back whole; the parent raises it in the stage that asked
            if not _reply(conn_out, ("error", traceback.format_exc())):
                return


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
