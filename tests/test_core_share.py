"""Idle cores handed to the fully-async trainer (relax.wire.core_share): the board across processes, the thread
count it gives, the calls at every layer of a real Megatron model's forward and backward passes, and when a run
shares cores at all (the derived fact)."""

import multiprocessing as mp

import pytest
import torch

from relax.config import parse_config
from relax.wire.core_share import ROLLOUT_SLOT, CoreBoard, ElasticThreads, board_path, new_token, remove_board


@pytest.fixture
def board():
    token = new_token()
    b = CoreBoard.for_run(token)
    yield b
    b.close()
    remove_board(token)


def _mark(path, slot, cores, done):
    other = CoreBoard(path)
    other.set(slot, cores)
    done.set()


def test_a_board_opened_by_another_process_shows_its_cores(board):
    done = mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(target=_mark, args=(board.path, 5, 3, done))
    proc.start()
    proc.join(60)
    assert done.is_set() and board.busy_cores() == 3
    board.set(ROLLOUT_SLOT, 1)
    assert board.busy_cores() == 4
    assert CoreBoard(board.path).busy_cores() == 4  # opening it again keeps what is written


def test_computing_marks_the_slot_busy_until_the_block_ends_also_on_an_error(board):
    with board.computing(ROLLOUT_SLOT, 2):
        assert board.busy_cores() == 2
    assert board.busy_cores() == 0
    with pytest.raises(RuntimeError):
        with board.computing(ROLLOUT_SLOT, 1):
            raise RuntimeError("generation failed")
    assert board.busy_cores() == 0


def test_the_trainer_takes_the_idle_cores_and_never_goes_below_its_share(board):
    calls, now = [], [0.0]
    elastic = ElasticThreads(board, own=1, node=2, set_threads=calls.append, clock=lambda: now[0])
    assert elastic.apply() == 2 and calls == [2]  # nothing else computes: both cores
    now[0] = 3.0
    board.set(ROLLOUT_SLOT, 1)
    assert elastic.apply() == 1 and calls == [2, 1]  # the engines generate: its own share
    assert elastic.apply() == 1 and calls == [2, 1]  # unchanged: torch is not called again
    board.set(7, 4)
    assert elastic.apply() == 1  # more busy cores than the node has: still its own share
    now[0] = 4.0
    assert elastic.mean() == pytest.approx((2 * 3.0 + 1 * 1.0) / 4.0)
    elastic.reset()
    board.set(7, 0)
    board.set(ROLLOUT_SLOT, 0)
    elastic.apply()
    now[0] = 6.0
    assert elastic.mean() == pytest.approx(2.0)


def test_the_calls_come_at_every_layer_forward_and_backward(model_dir, megatron_process):
    from relax.backends.megatron.layer_hooks import at_every_layer
    from relax.backends.megatron.testing import hf_trainer, toy_pg_loss, toy_samples

    trainer = hf_trainer(model_dir, lr=1e-3, micro_batch_size=8, seed=7)
    seen = []
    layers = at_every_layer(trainer.model, lambda: seen.append(1))
    assert layers == trainer.arch.num_layers
    samples = toy_samples(4, seed=2)
    trainer.compute_logprobs(samples)
    assert len(seen) == layers  # a forward-only pass: one call before each layer
    seen.clear()
    for s, lp in zip(samples, trainer.compute_logprobs(samples)):
        s["old_logprobs"] = lp
    seen.clear()
    trainer.train_step(samples, toy_pg_loss)
    # one micro-batch: each layer's forward, then its backward (the gradient of its output)
    assert len(seen) == 2 * layers, seen


def test_only_fully_async_runs_with_staleness_of_a_wide_model_share_cores(tmp_path, monkeypatch):
    import json

    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "config.json").write_text(json.dumps({"hidden_size": 576}))
    monkeypatch.delenv("RELAX_SHARE_IDLE_CORES", raising=False)
    base = ["--output-dir", str(tmp_path)]
    s1 = ["--fully-async", "--max-staleness", "1"]
    assert not parse_config(base + ["--hf-checkpoint", str(wide)]).shares_idle_cores  # synchronous
    assert not parse_config(base + ["--hf-checkpoint", str(wide), "--fully-async", "--max-staleness", "0"]
                            ).shares_idle_cores  # the synchronous schedule
    assert parse_config(base + ["--hf-checkpoint", str(wide)] + s1).shares_idle_cores
    assert not parse_config(base + s1).shares_idle_cores  # the embedded default: 64 wide, its kernels too small
    monkeypatch.setenv("RELAX_SHARE_IDLE_CORES", "1")
    assert parse_config(base + s1).shares_idle_cores
    monkeypatch.setenv("RELAX_SHARE_IDLE_CORES", "0")
    assert not parse_config(base + ["--hf-checkpoint", str(wide)] + s1).shares_idle_cores


def test_the_board_lives_in_shared_memory():
    assert board_path("abc").endswith("relax-cores-abc")
