"""relax.roles.background.BackgroundCall: the value or the error of a call made on a thread, in the caller's
thread; the call really runs beside the caller (the in-trainer reference pass beside the actor's forward)."""

import threading

import pytest
import torch

from relax.roles.background import BackgroundCall


def test_value_error_and_thread_count():
    torch.set_num_threads(1)
    assert BackgroundCall(lambda: (threading.current_thread().name, torch.get_num_threads()), "bg").result() == (
        "bg", 1)
    failing = BackgroundCall(lambda: 1 / 0, "bg")
    with pytest.raises(ZeroDivisionError):
        failing.result()


def test_runs_beside_the_caller():
    started, release = threading.Event(), threading.Event()

    def work():
        started.set()
        assert release.wait(10), "the caller never got to run while the call was in progress"
        return "done"

    call = BackgroundCall(work, "bg")
    assert started.wait(10)
    release.set()  # only reachable while `work` is still running on its own thread
    assert call.result() == "done"
