"""relax.backends.megatron.rng_forks: a thread inside `forks_off()` leaves Megatron's process-wide RNG tracker
alone, so a forward-only pass can run beside a pass that forks it (the in-trainer reference pass beside the
actor's forward); other threads fork as before. The interleaving below (one thread's fork spanning the other's
exit) is the one that failed a run: "current state name default-rng is not the same as the desired state name
model-parallel-rng"."""

import contextlib
import threading

import pytest
import torch

from relax.backends.megatron.cpu_compat import apply_cpu_compat
from relax.backends.megatron.rng_forks import forks_off
from relax.backends.megatron.testing import ensure_single_process


def _interleaved_forks(off: bool) -> bool:
    """The other thread enters a fork; this one enters a fork; the other leaves; this one leaves. Returns whether
    the generator ended where it started."""
    apply_cpu_compat()
    ensure_single_process()
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random.model_parallel_cuda_manual_seed(123)
    tracker = mcore_random.get_cuda_rng_tracker()
    before = torch.get_rng_state()
    inside, release, errors = threading.Event(), threading.Event(), []

    def other_pass():  # as the actor's forward around a dropout
        try:
            with tracker.fork():
                inside.set()
                release.wait(10)
        except Exception as exc:  # reported below
            errors.append(exc)

    other = threading.Thread(target=other_pass)
    other.start()
    assert inside.wait(10)
    try:
        with forks_off() if off else contextlib.nullcontext(), tracker.fork():
            release.set()
            other.join(10)
    finally:
        release.set()
        other.join(10)
        tracker._current_state_name = "default-rng"  # for the next case, whatever happened
    assert not errors, errors
    return torch.equal(torch.get_rng_state(), before)


def test_forks_off_on_one_thread_keeps_the_tracker_consistent():
    assert _interleaved_forks(off=True)  # and the generator is back where it was


def test_without_it_the_same_interleaving_fails():
    with pytest.raises(Exception, match="is not the same as the desired state name"):
        _interleaved_forks(off=False)
