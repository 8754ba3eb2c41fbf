"""A rollout-only run's saved file replays with no other flag: the model and batch shape come from its header."""

import json

import pytest

from relax.config import ConfigError, parse_config
from relax.formats.replay_record import RECORDED_FLAGS, recorded_run, run_record
from relax.data.sample import Sample
from relax.rollout.debug_data import load_rollout_data, save_rollout_data


def _save(tmp_path):
    source = parse_config(["--hf-checkpoint", str(tmp_path), "--prompt-data", __file__, "--rollout-batch-size", "3",
                           "--n-samples-per-prompt", "2", "--num-rollout", "1", "--dry-run"])
    samples = [Sample(index=i, group_index=i // 2, prompt="p", prompt_tokens=[1, 2], response_tokens=[3], reward=1.0)
               for i in range(6)]
    template = str(tmp_path / "rollout_{rollout_id}.jsonl")
    save_rollout_data(template, 0, samples, run=run_record(source))
    return template, source


def test_header_records_the_run_and_samples_still_load(tmp_path):
    template, source = _save(tmp_path)
    assert recorded_run(template) == {name: getattr(source, name) for name in RECORDED_FLAGS}
    assert len(load_rollout_data(template, 0)) == 6


def test_replay_needs_no_other_flag(tmp_path):
    template, source = _save(tmp_path)
    config = parse_config(["--load-debug-rollout-data", template, "--num-rollout", "1",
                           "--output-dir", str(tmp_path / "replay")])
    assert (config.hf_checkpoint, config.rollout_batch_size, config.n_samples_per_prompt) == (str(tmp_path), 3, 2)
    assert config.debug_train_only


def test_an_explicit_flag_that_disagrees_is_named(tmp_path):
    template, _ = _save(tmp_path)
    with pytest.raises(ConfigError, match=r"--rollout-batch-size 4 differs .*\(3, recorded in"):
        parse_config(["--load-debug-rollout-data", template, "--num-rollout", "1", "--rollout-batch-size", "4"])


def test_a_file_that_is_not_a_replay_file_is_named(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text(json.dumps({"prompt": "p"}) + "\n")
    with pytest.raises(ConfigError, match="not a Relax debug rollout file"):
        parse_config(["--load-debug-rollout-data", str(bad), "--num-rollout", "1"])
