"""Megatron-LM's checkpoint-content and run-control flags as Relax builds them, without Ray: which iteration a
resume loads (--ckpt-step), what --finetune / --pretrained-checkpoint restore, which checkpoints a rotation keeps
(--save-retain-interval), the skipped steps, deadline and signal of relax.core.run_control, the flight recorder's
environment, and the errors before Ray. The whole chain through a run: tests/test_ckpt_contents_e2e.py."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from relax.formats import checkpoint_layout as layout
from relax.config import parse_config
from relax.config.errors import ConfigError
from relax.config.support import unsupported_flags
from relax.config.support_gpu import flight_recorder_env, require_gpu_for
from relax.core import checkpointing
from relax.core.checkpointing import resume_from, rotate_checkpoints
from relax.core.preflight import check_load, check_pretrained
from relax.core.run_control import RunControl


def _save_root(root: Path, ids, marker=None) -> Path:
    """A save root whose iterations have the files a complete checkpoint has (tiny ones)."""
    for i in ids:
        actor = layout.iter_dir(root, i) / "actor"
        actor.mkdir(parents=True)
        torch.save({"i": i}, actor / layout.rank_file(0))
        layout.write_meta(actor, {"iteration": i, "optimizer_saved": True})
        layout.write_run_state(actor.parent, i, {"next_index": 10 * i})
    if ids:
        layout.write_marker(root, max(ids) if marker is None else marker)
    return root


def _config(tmp_path, *args):
    return parse_config(["--output-dir", str(tmp_path / "out"), *args])


# ----------------------------------------------------------------------------- choosing and keeping iterations
def test_select_iteration_takes_ckpt_step_and_lists_the_complete_ones(tmp_path):
    root = _save_root(tmp_path / "ckpt", [2, 4, 6])
    assert layout.select_iteration(root) == 6
    assert layout.select_iteration(root, 4) == 4
    (layout.iter_dir(root, 6) / "actor" / layout.META_FILE).unlink()  # an incomplete one is not offered
    with pytest.raises(ValueError, match=r"iteration 5 cannot be loaded .*complete iterations in .*: 2, 4$"):
        layout.select_iteration(root, 5)


def test_rotation_keeps_the_newest_and_the_multiples_of_the_retain_interval():
    ids = [1, 2, 3, 4, 5, 6, 7]
    assert layout.iterations_to_delete(ids, 2, 3, 7) == [1, 2, 4, 5]  # newest 2 (6, 7) and 3, 6
    # alone, as Megatron-LM: the last checkpoint and the multiples
    assert layout.iterations_to_delete(ids, None, 2, 7) == [1, 3, 5]
    assert layout.iterations_to_delete(ids, 3, None, 7) == [1, 2, 3, 4]
    assert layout.iterations_to_delete(ids, None, None, 7) == []
    assert layout.iterations_to_delete([4, 5, 9], 1, None, 5) == [4]  # never the marker's (a --ckpt-step rerun)


def test_rotate_checkpoints_on_disk(tmp_path):
    root = _save_root(tmp_path / "ckpt", [1, 2, 3, 4, 5])
    removed = rotate_checkpoints(root, 1, 2)
    assert sorted(p.name for p in removed) == ["iter_0000001", "iter_0000003"]
    assert [i for i, _ in layout.iterations(root)] == [2, 4, 5]


# ----------------------------------------------------------------------------- what a resume restores
class _Call:
    def __init__(self, fn):
        self.remote = fn


class _Worker:
    """A trainer rank's surface that resume_from uses; `ray.get` is the identity here (see the fixture)."""

    def __init__(self):
        self.calls = []
        self.trainer = SimpleNamespace(load_weights=lambda path, step=None: self.calls.append(
            ("load_weights", str(path), step)) or "relax")
        self.__ray_call__ = _Call(lambda fn, *a: fn(self, *a))
        self.load = _Call(lambda path: self.calls.append(("load", path)))
        self.push_weights = _Call(lambda urls, version, buffer: self.calls.append(("push", version)))


class _Rollout:
    def __init__(self):
        self.loaded = None
        self.load_state_dict = _Call(lambda state: setattr(self, "loaded", state))


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.setattr(checkpointing.ray, "get", lambda refs: refs)


def _resume(parts, load):
    """resume_from on the parts a run holds; the step it returns is where the run starts."""
    parts.start_step = resume_from(parts.config, parts.workers, parts.aux, parts.rollout, parts.engine_urls, load)


def _controller(config):
    return SimpleNamespace(config=config, workers=[_Worker()], aux=None, rollout=_Rollout(), engine_urls=["e"],
                           start_step=0)


def test_ckpt_step_resumes_that_iteration_with_everything(tmp_path, fake_ray):
    root = _save_root(tmp_path / "ckpt", [2, 4])
    ctl = _controller(_config(tmp_path, "--load", str(root), "--ckpt-step", "2"))
    _resume(ctl, str(root))
    assert ctl.workers[0].calls == [("load", str(layout.iter_dir(root, 2) / "actor")), ("push", 2)]
    assert ctl.start_step == 2 and ctl.rollout.loaded == {"next_index": 20}


def test_finetune_loads_the_weights_only_and_starts_at_step_0(tmp_path, fake_ray):
    root = _save_root(tmp_path / "ckpt", [2, 4])
    ctl = _controller(_config(tmp_path, "--load", str(root), "--finetune"))
    _resume(ctl, str(root))
    # the weights alone (no optimizer, scheduler or RNG: MegatronTrainer.load_weights), version 0 to the engines
    assert ctl.workers[0].calls == [("load_weights", str(layout.iter_dir(root, 4)), None), ("push", 0)]
    assert ctl.start_step == 0 and ctl.rollout.loaded is None  # the rollout position starts afresh


def test_pretrained_checkpoint_is_read_while_load_holds_none(tmp_path, fake_ray):
    pre = _save_root(tmp_path / "pre", [3, 5])
    empty = tmp_path / "run"
    ctl = _controller(_config(tmp_path, "--load", str(empty), "--save", str(empty), "--pretrained-checkpoint",
                              str(pre), "--ckpt-step", "3"))
    _resume(ctl, str(empty))
    assert ctl.workers[0].calls == [("load_weights", str(pre), 3), ("push", 0)] and ctl.start_step == 0
    # once --load holds a checkpoint, the run resumes from it and the pretrained one is not read
    _save_root(empty, [1])
    ctl = _controller(_config(tmp_path, "--load", str(empty), "--pretrained-checkpoint", str(pre)))
    _resume(ctl, str(empty))
    assert ctl.workers[0].calls[0] == ("load", str(layout.iter_dir(empty, 1) / "actor")) and ctl.start_step == 1


# ----------------------------------------------------------------------------- errors before Ray
@pytest.mark.parametrize("args, message", [
    (["--ckpt-step", "3"], "--ckpt-step picks an iteration of the checkpoint that is loaded; add --load"),
    (["--finetune"], r"--finetune loads the weights of --load \(or --pretrained-checkpoint\)"),
    (["--save-retain-interval", "2"], "--save-retain-interval keeps every checkpoint .* add --save"),
    (["--save", "x", "--save-retain-interval", "0"], "--save-retain-interval 0 must be a number of rollout steps"),
    (["--exit-signal", "SIGUSR1"], "--exit-signal SIGUSR1 names the signal --exit-signal-handler waits for"),
    (["--exit-signal-handler", "--exit-signal", "SIGKILL"], "--exit-signal SIGKILL cannot be caught"),
    (["--iterations-to-skip", "0", "3"], "--iterations-to-skip 0: iterations are 1-indexed"),
    (["--exit-duration-in-mins", "-1"], "--exit-duration-in-mins -1 must be"),
    (["--fully-async", "--iterations-to-skip", "2"], "--iterations-to-skip with --fully-async is not supported yet"),
])
def test_inconsistent_flags_fail_at_parse_naming_them(tmp_path, args, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, *args)


def test_preflight_names_the_missing_iteration_and_lists_the_complete_ones(tmp_path):
    root = _save_root(tmp_path / "ckpt", [2, 4])
    with pytest.raises(ConfigError, match=r"--ckpt-step 3 with --load .*: iteration 3 cannot be loaded .*: 2, 4$"):
        check_load(_config(tmp_path, "--load", str(root), "--ckpt-step", "3"))
    assert check_load(_config(tmp_path, "--load", str(root), "--ckpt-step", "2")) == []
    with pytest.raises(ConfigError, match="--ckpt-step 1: --load .* holds no checkpoint"):
        check_load(_config(tmp_path, "--load", str(tmp_path / "new"), "--save", str(tmp_path / "new"),
                           "--ckpt-step", "1"))
    with pytest.raises(ConfigError, match="--pretrained-checkpoint: .* does not exist"):
        check_pretrained(_config(tmp_path, "--pretrained-checkpoint", str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match=r"--ckpt-step 7 with --pretrained-checkpoint .*: 2, 4$"):
        check_pretrained(_config(tmp_path, "--pretrained-checkpoint", str(root), "--ckpt-step", "7"))
    assert check_pretrained(_config(tmp_path, "--pretrained-checkpoint", str(root), "--ckpt-step", "2")) == []


def test_the_built_flags_are_not_refused(tmp_path):
    config = _config(tmp_path, "--load", str(tmp_path), "--save", str(tmp_path), "--ckpt-step", "2", "--finetune",
                     "--pretrained-checkpoint", str(tmp_path), "--save-retain-interval", "5",
                     "--exit-duration-in-mins", "30", "--exit-signal-handler", "--exit-signal", "SIGUSR1",
                     "--iterations-to-skip", "3", "7")
    assert unsupported_flags(config) == []


# ----------------------------------------------------------------------------- run control
def test_iterations_to_skip_are_one_indexed_and_the_deadline_counts_from_the_start(tmp_path):
    now = [1000.0]
    config = _config(tmp_path, "--iterations-to-skip", "2", "5", "--exit-duration-in-mins", "2")
    rc = RunControl(config, clock=lambda: now[0])
    assert [s for s in range(6) if rc.skips(s)] == [1, 4]
    now[0] += 119
    assert rc.stop_reason() is None
    now[0] += 2
    assert rc.stop_reason() == "--exit-duration-in-mins 2: 2.0 min since the run started"
    # a restarted attempt (--use-health-check) keeps counting from the first one's start
    assert RunControl(config, attempt=1, clock=lambda: now[0]).started == 1000.0


def test_exit_signal_is_noted_and_a_second_one_stops_at_once(tmp_path):
    rc = RunControl(_config(tmp_path, "--exit-signal-handler", "--exit-signal", "SIGUSR1"))
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        with rc.signal_handler():
            os.kill(os.getpid(), signal.SIGUSR1)
            assert rc.received == "SIGUSR1" and seen == []
            assert rc.stop_reason() == "SIGUSR1 received (--exit-signal-handler)"
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler it replaced (relax.core.run: stop at once)
            assert seen == [signal.SIGUSR1]
        os.kill(os.getpid(), signal.SIGUSR1)  # restored afterwards
        assert seen == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, previous)


# ----------------------------------------------------------------------------- the flight recorder (GPU only)
def test_flight_recorder_environment_as_megatron_sets_it(tmp_path, monkeypatch):
    assert flight_recorder_env(_config(tmp_path), environ={}) == {}  # off without a dump path
    config = _config(tmp_path, "--flight-recorder-dump-path", str(tmp_path), "--flight-recorder-trace-buffer-size",
                     "500", "--no-flight-recorder-dump-on-timeout", "--train-env-vars",
                     json.dumps({"TORCH_INCLUDE_ONLY_ACTIVE": "0"}))
    env = flight_recorder_env(config, environ={"TORCH_NCCL_EXTRA_DUMP_ON_EXEC": "0"})
    prefix = os.path.join(str(tmp_path), "_dump_")  # a folder gets the per-rank prefix
    assert env == {"TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
                   "TORCH_NCCL_TRACE_BUFFER_SIZE": "500", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                   "TORCH_INCLUDE_STACK_TRACE": "0"}  # variables already set keep their values
    monkeypatch.setattr("relax.config.support_gpu.local_run_has_gpu", lambda: False)
    with pytest.raises(ConfigError, match=r"--flight-recorder-dump-path \(switches on NCCL's flight recorder"):
        require_gpu_for(config)
