"""Checkpoint saving and loading through `relax.core.checkpointing` with a real trainer actor (Megatron on
gloo, one rank, tiny model): a crash mid-save keeps the previous checkpoint, --no-save-optim / --no-load-optim,
--async-save with rotation, --save-hf (reloads in transformers with the trainer's log-probs)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import ray
import torch

from conftest import shared_ray, shared_tiny_model

from relax.config import parse_config
from relax.core import checkpointing
from relax.core.checkpointing import CheckpointError, resume_from, save_checkpoint, wait_for_pending_save
from relax.models.tasks import generate_task_dataset


@ray.remote
class FakeRollout:
    def __init__(self):
        self.state = {"next_index": 0}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)

    def set(self, n):
        self.state = {"next_index": n}


def _train(worker, seed: int) -> float:
    def fn(w, s):
        from relax.backends.megatron.testing import toy_pg_loss, toy_samples

        return w.trainer.train_step(toy_samples(4, seed=s, vocab=200), toy_pg_loss)["loss"]

    return ray.get(worker.__ray_call__.remote(fn, seed))


def _state(worker) -> dict:
    def fn(w):
        from relax.backends.megatron.checkpoint import cpu_copy, optimizer_state

        return {"model": w.trainer.model_state(), "optim": cpu_copy(optimizer_state(w.trainer.optimizer)),
                "iteration": w.trainer.iteration}

    return ray.get(worker.__ray_call__.remote(fn))


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _save(parts, rollout_id):
    """save_checkpoint of the parts a run holds, with the rollout position of the moment."""
    state = ray.get(parts.rollout.state_dict.remote())
    return save_checkpoint(parts.config, parts.workers, parts.aux, state, rollout_id)


def _resume(parts, load):
    """resume_from on the parts a run holds; the step it returns is where the run starts."""
    parts.start_step = resume_from(parts.config, parts.workers, parts.aux, parts.rollout, parts.engine_urls, load)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from relax.data.plane import DataPlane
    from relax.roles.trainer import TrainerWorker

    base = tmp_path_factory.mktemp("ckpt")
    model = str(shared_tiny_model())
    data = str(generate_task_dataset(base / "train.jsonl", 8, seed=0, task="add_mod10"))
    common = ["--hf-checkpoint", model, "--prompt-data", data, "--input-key", "input", "--label-key", "label",
              "--lr", "1e-2", "--num-rollout", "100", "--micro-batch-size", "2", "--rollout-batch-size", "2",
              "--n-samples-per-prompt", "2",
              "--resource", '{"actor": [1, 1], "rollout": [1, 1]}']
    shared_ray()
    plane = DataPlane.start(1, capacity_samples=16, layout="packed")
    worker = TrainerWorker.options(num_cpus=1).remote(parse_config(common), 0, 1, 1)
    addr, port = ray.get(worker.master_address.remote())
    ray.get(worker.setup.remote(addr, port, "gloo"))
    rollout = FakeRollout.remote()

    def controller(*flags, save=None):
        save = str(save or base / "save")
        config = parse_config(common + ["--save", save, "--output-dir", str(base / "out"), *flags])
        return SimpleNamespace(config=config, workers=[worker], aux=None, rollout=rollout, engine_urls=[],
                               start_step=0)

    try:
        yield SimpleNamespace(base=base, model=model, worker=worker, rollout=rollout, controller=controller)
    finally:
        ray.kill(worker)
        ray.kill(rollout)
        plane.shutdown()


def test_crash_mid_save_keeps_previous_checkpoint(env, tmp_path, monkeypatch):
    ctl = env.controller(save=tmp_path / "save")
    _train(env.worker, 1)
    ray.get(env.rollout.set.remote(11))
    _save(ctl, 1)
    saved = _state(env.worker)
    _train(env.worker, 2)
    ray.get(env.rollout.set.remote(22))

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(checkpointing, "_write_rollout_state", crash)
    with pytest.raises(KeyboardInterrupt):
        _save(ctl, 2)  # the actor part is on disk (in staging), then the "kill"
    monkeypatch.undo()
    root = tmp_path / "save"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not (root / "iter_0000002").exists()
    assert (root / ".tmp_iter_0000002" / "iter_0000002" / "actor" / "rank00000.pt").is_file()

    _train(env.worker, 3)
    ctl2 = env.controller(save=tmp_path / "save")
    _resume(ctl2, str(root))
    assert ctl2.start_step == 1
    _assert_same(saved, _state(env.worker))
    assert ray.get(env.rollout.state_dict.remote()) == {"next_index": 11}
    # the next save clears the leftovers of the crashed one
    _save(ctl2, 2)
    assert not (root / ".tmp_iter_0000002").exists()
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_no_save_optim_refuses_training_resume_unless_no_load_optim(env, tmp_path):
    root = tmp_path / "save"
    _train(env.worker, 4)
    _save(env.controller("--no-save-optim", save=root), 5)
    weights = _state(env.worker)["model"]
    meta = json.loads((root / "iter_0000005" / "actor" / "meta.json").read_text())
    assert meta["optimizer_saved"] is False
    state = torch.load(root / "iter_0000005" / "actor" / "rank00000.pt", weights_only=False)
    assert state["optimizer"] is None
    _train(env.worker, 5)
    with pytest.raises(CheckpointError, match="--no-save-optim and holds no optimizer state.*--no-load-optim"):
        _resume(env.controller(save=root), str(root))
    ctl = env.controller("--no-load-optim", save=root)
    _resume(ctl, str(root))
    assert ctl.start_step == 5
    _assert_same(weights, _state(env.worker)["model"])
    _train(env.worker, 6)  # trains on with a fresh optimizer


def test_async_save_snapshots_and_rotation(env, tmp_path):
    root = tmp_path / "save"
    ctl = env.controller("--async-save", "--save-interval", "1", "--rotate-ckpt", "--max-actor-ckpt-to-keep", "2",
                         save=root)
    snaps = {}
    for it in (1, 2, 3):
        _train(env.worker, 10 + it)
        ray.get(env.rollout.set.remote(100 + it))
        snaps[it] = _state(env.worker)
        _save(ctl, it)
        _train(env.worker, 20 + it)  # training goes on while the checkpoint is written
    wait_for_pending_save(ctl.config.save)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("iter_")) == ["iter_0000002", "iter_0000003"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"
    _resume(env.controller(save=root), str(root))
    _assert_same(snaps[3], _state(env.worker))  # the state at save time, not what training did afterwards
    assert ray.get(env.rollout.state_dict.remote()) == {"next_index": 103}


def test_save_hf_reloads_with_the_same_logits(env, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path / "save"
    _train(env.worker, 30)
    _save(env.controller("--save-hf", str(tmp_path / "hf_{rollout_id}"), save=root), 7)
    hf = tmp_path / "hf_7"
    assert (hf / "model.safetensors").is_file() and (hf / "config.json").is_file()
    assert not (tmp_path / "hf_7.tmp").exists()
    AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokens = [5, 17, 33, 2, 91, 64, 12, 8, 150, 3]
    n = 6
    trainer_lp = torch.tensor(ray.get(env.worker.compute_logprobs.remote([tokens], [n], 1.0))[0])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    hf_lp = torch.stack([lp[len(tokens) - n - 1 + j, tokens[len(tokens) - n + j]] for j in range(n)])
    assert torch.allclose(trainer_lp, hf_lp, atol=1e-4), (trainer_lp, hf_lp)
