"""Inputs on disk are checked before Ray starts: each mistake fails by name (flag, file, line, fix)."""

import json
import time

import pytest
import torch

from conftest import relax_cli
from relax.config import ConfigError, parse_config
from relax.core.checkpointing import MARKER
from relax.core.preflight import preflight
from relax.models.tiny import TinyArch, build_tiny_model_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "m", TinyArch(family="qwen2"), seed=0))


def _config(tmp_path, model, prompts, *extra):
    path = tmp_path / "prompts.jsonl"
    path.write_text(prompts)
    return parse_config(["--hf-checkpoint", model, "--prompt-data", str(path), "--input-key", "input",
                         "--rollout-batch-size", "2", "--num-rollout", "1", "--output-dir", str(tmp_path / "out"),
                         "--rm-type", "exact_match", *extra])


GOOD = '{"input": "1+1=", "label": "2"}\n{"input": "2+2=", "label": "4"}\n'


def test_good_inputs_pass(tmp_path, model):
    assert preflight(_config(tmp_path, model, GOOD)) == []


def test_missing_model_and_missing_tokenizer(tmp_path, model):
    (tmp_path / "p.jsonl").write_text(GOOD)
    config = parse_config(["--prompt-data", str(tmp_path / "p.jsonl"), "--rollout-batch-size", "1", "--num-rollout",
                           "1", "--input-key", "input"])
    with pytest.raises(ConfigError, match="--hf-checkpoint is required"):
        preflight(config)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    config = _config(tmp_path, str(bare), GOOD)
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        preflight(config)


def test_bad_row_is_named_by_file_and_line(tmp_path, model):
    config = _config(tmp_path, model, GOOD + '{"input": 5}\n')
    with pytest.raises(ConfigError, match=r"prompts.jsonl:3: .*input.*--skip-bad-lines"):
        preflight(config)
    notes = preflight(_config(tmp_path, model, GOOD + "{not json\n", "--skip-bad-lines"))
    assert any("1 bad row" in n for n in notes)


def test_empty_file_missing_labels_and_few_prompts_are_reported(tmp_path, model):
    with pytest.raises(ConfigError, match="is empty"):
        preflight(_config(tmp_path, model, ""))
    notes = preflight(_config(tmp_path, model, '{"input": "a"}\n', "--rollout-batch-size", "4", "--label-key", "label"))
    assert any("have no 'label' key" in n for n in notes)
    assert any("1 distinct prompt(s), fewer than --rollout-batch-size 4" in n for n in notes)


def test_eval_sets_are_scanned_with_their_own_keys(tmp_path, model):
    evals = tmp_path / "eval.jsonl"
    evals.write_text('{"question": "3+3=", "answer": "6"}\n')
    flags = ("--eval-prompt-data", "small", str(evals), "--eval-interval", "1", "--eval-input-key", "question")
    assert preflight(_config(tmp_path, model, GOOD, *flags, "--eval-label-key", "answer")) == []
    evals.write_text('{"question": "3+3=", "answer": "6"}\n{"prompt": "4+4="}\n')
    with pytest.raises(ConfigError, match=r"--eval-prompt-data small: .*eval.jsonl:2: missing input key 'question'"):
        preflight(_config(tmp_path, model, GOOD, *flags))


def _fake_checkpoint(root, rollout_id, truncate=False):
    it = root / f"iter_{rollout_id:07d}"
    actor = it / "actor"
    actor.mkdir(parents=True)
    (actor / "meta.json").write_text(json.dumps({"iteration": rollout_id}))
    (it / "relax_state.json").write_text("{}")
    torch.save({"model": {"w": torch.zeros(256)}}, actor / "rank00000.pt")
    if truncate:
        data = (actor / "rank00000.pt").read_bytes()
        (actor / "rank00000.pt").write_bytes(data[: len(data) // 2])
    (root / MARKER).write_text(str(rollout_id))


def test_load_paths(tmp_path, model):
    missing = str(tmp_path / "ckpt-typo")
    with pytest.raises(ConfigError, match="does not exist \\(a typo\\?\\)"):
        preflight(_config(tmp_path, model, GOOD, "--load", missing))
    notes = preflight(_config(tmp_path, model, GOOD, "--load", missing, "--save", missing))
    assert any("starting from step 0" in n for n in notes)
    empty = tmp_path / "empty-ckpt"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        preflight(_config(tmp_path, model, GOOD, "--load", str(empty)))
    with pytest.raises(ConfigError, match="holds model weights, not a run checkpoint.*--hf-checkpoint"):
        preflight(_config(tmp_path, model, GOOD, "--load", model))  # resuming would silently ignore them

    root = tmp_path / "ckpt"
    _fake_checkpoint(root, 2)
    _fake_checkpoint(root, 4, truncate=True)
    with pytest.raises(ConfigError, match=r"iteration 4: .*rank00000.pt is damaged or truncated.*newest complete "
                                          r"checkpoint is iteration 2"):
        preflight(_config(tmp_path, model, GOOD, "--load", str(root)))
    (root / MARKER).write_text("2")
    assert preflight(_config(tmp_path, model, GOOD, "--load", str(root))) == []


def test_cli_fails_before_ray_within_seconds(tmp_path, model):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(GOOD + "{broken\n")
    start = time.monotonic()
    proc = relax_cli("--hf-checkpoint", model, "--prompt-data", str(bad), "--input-key", "input",
                     "--rollout-batch-size", "2", "--num-rollout", "1", "--output-dir", str(tmp_path / "out"))
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "bad.jsonl:3: malformed JSON" in proc.stderr
    assert "Traceback" not in proc.stderr and "Ray instance" not in proc.stderr + proc.stdout
    assert elapsed < 60
