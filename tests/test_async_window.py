"""The fully-async schedule (relax.core.async_loop.StalenessWindow / run_window), driven without Ray: fake
stages with random delays. The staleness bound is checked independently of the window (the test's own
record of which steps have finished training), and every sample id goes in and comes out exactly once."""

import random
import threading
import time
from types import SimpleNamespace

import pytest

from relax.core import step_tail
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


def test_streaming_trains_chunks_before_the_step_is_generated():
    """run_window(streaming=True) (--num-iters-per-train-update): train(step, None) starts as soon as the window
    lets it, takes each chunk as the rollout stores it, then the step's result; a rollout failure between
    chunks reaches the training thread while it waits for the next chunk."""
    log = []
    window = StalenessWindow(0, 3, 1)

    def generate(step):
        for chunk in range(2):
            time.sleep(0.05)
            log.append(("stored", step, chunk))
            window.chunk_finished(step, chunk, {"indexes": [step * 10 + chunk]})
            time.sleep(0.1)  # the next chunk generates while the trainer takes this one
        log.append(("generated", step))
        return step

    def train(step, result):
        assert result is None
        for chunk in range(2):
            assert window.wait_chunk(step, chunk) == {"indexes": [step * 10 + chunk]}
            log.append(("trained", step, chunk))
        assert window.wait_finished(step) == step

    run_window(window, generate, train, streaming=True)
    for step in range(3):
        assert log.index(("trained", step, 0)) < log.index(("generated", step)), log

    def broken(step):
        window.chunk_finished(step, 0, {"indexes": []})
        raise ValueError("engine gone after chunk 0")

    window = StalenessWindow(0, 2, 0)
    with pytest.raises(ValueError, match="after chunk 0"):
        run_window(window, broken, lambda step, _: [window.wait_chunk(step, c) for c in range(2)], streaming=True)


class _FakeClient:
    def __init__(self, url, timeout_s):
        self.base_url = url

    def pause(self, mode):
        EVENTS.append(("pause", self.base_url, mode))

    def resume(self):
        EVENTS.append(("continue", self.base_url))

    def close(self):
        pass


EVENTS: list = []


class _FakeRun:
    """What relax.core.step_tail.push_weights uses of the run context."""

    def __init__(self, push_fails=False):
        self.config = SimpleNamespace(update_weight_buffer_size=1)
        self.deadlines = SimpleNamespace(control_s=5.0, train_s=5.0)
        self.push_fails = push_fails

    def rollout_call(self, method, action, step, *args):
        EVENTS.append((method,) + args)
        return ["http://e0", "http://e1"] if method == "push_targets" else None

    def trainers(self, method, action, step, *args):
        EVENTS.append((method, args[1]))
        if self.push_fails:
            raise RuntimeError("push failed")
        return [{"bytes": 1, "bytes_per_s": 1.0}]


@pytest.mark.parametrize("push_fails", [False, True])
def test_weight_push_pauses_every_engine_in_place_and_continues(monkeypatch, push_fails):
    """No decode step between the first and the last tensor of a push: every engine is paused in place before
    the trainer pushes and continued after (also when the push fails)."""
    monkeypatch.setattr(step_tail, "EngineClient", _FakeClient)
    EVENTS.clear()
    if push_fails:
        with pytest.raises(RuntimeError, match="push failed"):
            step_tail.push_weights(_FakeRun(push_fails), 4, pause=True)
    else:
        step_tail.push_weights(_FakeRun(push_fails), 4, pause=True)
    names = [e[0] for e in EVENTS]
    assert EVENTS[1:3] == [("pause", "http://e0", "in_place"), ("pause", "http://e1", "in_place")]
    assert names[3] == "push_weights" and EVENTS[3][1] == 5  # version step + 1
    assert names[-2:] == ["continue", "continue"]
    assert ("weights_pushed" in names) != push_fails


def test_synchronous_weight_push_pauses_nothing(monkeypatch):
    """Without generation in flight (the synchronous loop) the push goes straight to the pool's engines."""
    monkeypatch.setattr(step_tail, "EngineClient", _FakeClient)
    EVENTS.clear()
    step_tail.push_weights(_FakeRun(), 2, pause=False)
    assert [e[0] for e in EVENTS] == ["push_targets", "push_weights", "weights_pushed"]
    assert EVENTS[2] == ("weights_pushed", 3, ["http://e0", "http://e1"])


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_prepare_runs_each_step_once_in_order_and_ahead_of_training(max_staleness):
    """run_window(prepare=...) (the reference and teacher passes, relax.core.stages.Stages.ahead): a third thread
    prepares each generated step in order, `train` gets what `prepare` returned, and with staleness >= 1 the
    next step is prepared while the current one trains."""
    lock = threading.Lock()
    log = []
    prepared_next = threading.Event()

    def prepare(step, ids):
        with lock:
            log.append(("prepared", step))
        if step == 1:
            prepared_next.set()
        return {"ids": ids, "prepared": step}

    def train(step, result):
        assert result == {"ids": list(range(step * PER_STEP, (step + 1) * PER_STEP)), "prepared": step}
        if step == 0 and max_staleness:  # step 1 may generate now, and its passes run while step 0 trains
            assert prepared_next.wait(5), "step 1 was not prepared while step 0 trained"
        with lock:
            log.append(("trained", step))

    run_window(StalenessWindow(0, 6, max_staleness),
               lambda step: list(range(step * PER_STEP, (step + 1) * PER_STEP)), train, prepare=prepare)
    assert [s for kind, s in log if kind == "prepared"] == list(range(6))
    assert [s for kind, s in log if kind == "trained"] == list(range(6))
    for step in range(6):
        assert log.index(("prepared", step)) < log.index(("trained", step))
    if max_staleness:
        assert log.index(("prepared", 1)) < log.index(("trained", 0))


def test_prepare_failure_stops_the_loop_and_is_raised():
    started = []

    def prepare(step, result):
        if step == 2:
            raise ValueError("reference role gone at step 2")
        return result

    window = StalenessWindow(0, 10, 1)
    with pytest.raises(ValueError, match="reference role gone at step 2"):
        run_window(window, lambda step: started.append(step) or step, lambda step, _: time.sleep(0.02),
                   prepare=prepare)
    assert window.stopping and max(started) <= 3
