"""One call on a thread of this process, waited for later (`BackgroundCall.result`).

Used where two passes of one step are independent and each is mostly kernels that release the GIL: on a CPU
machine the in-trainer reference pass (relax.roles.trainer.TrainerWorker.reference_logprobs) runs beside the
actor's forward pass, each on its own core."""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch


class BackgroundCall:
    """`fn()` on a daemon thread, started at once; `result()` waits for it and returns its value or raises its
    error (in the caller's thread, so the stage that waits names it)."""

    def __init__(self, fn: Callable[[], Any], name: str):
        self._value: Any = None
        self._error: BaseException | None = None
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            # the process's torch thread count for this thread too (OpenMP keeps it per thread)
            torch.set_num_threads(self._threads)
            self._value = fn()
        except BaseException as exc:  # raised again by result()
            self._error = exc

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
