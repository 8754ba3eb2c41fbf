"""The fully-async schedule (relax.core.async_loop.StalenessWindow / run_window), driven without Ray: fake
stages with random delays. The staleness bound is checked independently of the window (the test's own
record of which steps have finished training), and every sample id goes in and comes out exactly once."""

import random
import threading
import time

import pytest

from relax.core.async_loop import StalenessWindow, run_window

STEPS = 20
PER_STEP = 4  # sample ids per step


def _drive(max_staleness: int, seed: int, start: int = 0):
    rng = random.Random(seed)
    delays = {step: (rng.uniform(0, 0.01), rng.uniform(0, 0.01)) for step in range(start, STEPS)}
    lock = threading.Lock()
    trained_upto = [start]  # steps below this have finished training (the test's own view)
    generated_ids: list[int] = []
    trained_ids: list[int] = []
    lags: list[int] = []
    order: list[int] = []
    rollout_running = []

    def generate(step):
        with lock:
            lag = step - trained_upto[0]  # step minus the oldest step not yet trained
            lags.append(lag)
            assert lag <= max_staleness, f"step {step} started {lag} steps ahead (bound {max_staleness})"
            rollout_running.append(step)
        time.sleep(delays[step][0])
        ids = list(range(step * PER_STEP, (step + 1) * PER_STEP))
        with lock:
            generated_ids.extend(ids)
        return ids

    def train(step, ids):
        order.append(step)
        time.sleep(delays[step][1])
        trained_ids.extend(ids)
        with lock:
            trained_upto[0] = step + 1

    run_window(StalenessWindow(start, STEPS, max_staleness), generate, train)
    return generated_ids, trained_ids, lags, order


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bound_and_exactly_once(max_staleness, seed):
    generated, trained, lags, order = _drive(max_staleness, seed)
    assert order == list(range(STEPS))
    assert sorted(generated) == list(range(STEPS * PER_STEP))
    assert sorted(trained) == list(range(STEPS * PER_STEP)) and len(set(trained)) == len(trained)
    assert max(lags) <= max_staleness
    if max_staleness == 0:
        assert set(lags) == {0}  # strict alternation: a step starts only once the previous one is trained


def test_rollout_runs_ahead_when_allowed():
    """With S = 2 and training much slower than rollout, the rollout really uses the window (lag 2 occurs)."""
    window = StalenessWindow(0, 6, 2)
    lags = []

    def generate(step):
        lags.append(step - window.oldest_unconsumed)
        return step

    run_window(window, generate, lambda step, _: time.sleep(0.05))
    assert max(lags) == 2


def test_resume_start_and_out_of_order():
    _, trained, _, order = _drive(1, 5, start=7)
    assert order == list(range(7, STEPS)) and sorted(trained) == list(range(7 * PER_STEP, STEPS * PER_STEP))
    window = StalenessWindow(0, 3, 1)
    with pytest.raises(RuntimeError, match="out of order"):
        window.consumed(1)


def test_errors_stop_both_sides():
    """A rollout failure reaches the training thread; a training failure stops the rollout thread."""
    def bad_generate(step):
        if step == 3:
            raise ValueError("engine gone at step 3")
        return step

    with pytest.raises(ValueError, match="step 3"):
        run_window(StalenessWindow(0, 10, 1), bad_generate, lambda step, _: None)

    started = []
    window = StalenessWindow(0, 10, 1)

    def train(step, _):
        if step == 2:
            raise KeyboardInterrupt("SIGINT")

    with pytest.raises(KeyboardInterrupt):
        run_window(window, lambda step: started.append(step) or step, train)
    time.sleep(0.3)
    assert window.stopping and max(started) <= 3  # nothing started past the bound after the stop
