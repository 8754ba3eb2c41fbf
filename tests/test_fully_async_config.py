"""Parse-time rules of --fully-async (relax.config.validate): --balance-data is accepted with a warning that
says what it does there; --colocate is refused naming both flags; --max-staleness needs --fully-async;
--num-iters-per-train-update K > 1 (relax.config.rules_streaming) is accepted where a chunked step is exactly
the unchunked update and refused otherwise, naming the flags and why."""

import logging
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from relax.config import ConfigError, parse_config
from relax.config.support import unsupported_flags

BASE = ["--output-dir", "/tmp/relax-test-cfg"]


def test_balance_data_is_accepted_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="relax"):
        config = parse_config(BASE + ["--fully-async", "--max-staleness", "2", "--balance-data"])
    assert config.fully_async and config.max_staleness == 2 and config.balance_data
    assert any("--balance-data with --fully-async: no effect on the rollout" in r.message for r in caplog.records)
    assert unsupported_flags(config) == []


def test_colocate_is_refused():
    with pytest.raises(ConfigError, match="--colocate cannot be combined with --fully-async"):
        parse_config(BASE + ["--fully-async", "--colocate"])


CHUNKS = ["--num-iters-per-train-update", "2"]
# a model and prompts of the user's (the embedded default preset trains with a KL loss): 4 prompts x 2 samples,
# one optimizer step per rollout step
STEP = ["--hf-checkpoint", "/tmp/relax-test-cfg/model", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--num-rollout", "2", "--fully-async"]


@pytest.fixture
def streaming(prompt_file):
    return BASE + STEP + ["--prompt-data", prompt_file] + CHUNKS


def test_streaming_chunks_are_accepted_where_exact(streaming):
    config = parse_config(streaming)
    assert config.num_iters_per_train_update == 2 and config.global_batch_size == 8
    assert unsupported_flags(config) == []
    # a KL loss or KL reward: the reference role computes each chunk's log-probs (relax.core.streaming)
    for kl in (["--use-kl-loss", "--kl-loss-coef", "0.01"], ["--kl-coef", "0.01"]):
        assert unsupported_flags(parse_config(streaming + kl)) == []
    assert parse_config(BASE).num_iters_per_train_update == 1  # the unchunked step by default


@pytest.mark.parametrize("extra, message", [
    (["--num-iters-per-train-update", "3"], r"--num-iters-per-train-update 3 must divide --rollout-batch-size \(4\)"),
    (["--num-steps-per-rollout", "2"], r"needs one optimizer step per rollout step \(--num-steps-per-rollout 1.*"
                                       "old log-probs would be computed after an optimizer step"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "t"], "cannot be combined with --use-opd"),
    (["--advantage-estimator", "ppo"], "cannot be combined with --advantage-estimator ppo"),
    (["--normalize-advantages"], "cannot be combined with --normalize-advantages: whitening"),
    (["--over-sampling-batch-size", "8"], "cannot be combined with --over-sampling-batch-size"),
    (["--n-samples-per-prompt", "1", "--micro-batch-size", "1", "--resource", '{"actor": [1, 4], "rollout": [1, 1]}'],
     "a chunk of 2 samples .* fewer samples than the 4 data-parallel trainer ranks"),
])
def test_streaming_chunks_refused_outside_the_exact_slice(streaming, extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(streaming + extra)


def test_streaming_chunks_need_fully_async(streaming):
    with pytest.raises(ConfigError, match="--num-iters-per-train-update 2 needs --fully-async"):
        parse_config([a for a in streaming if a != "--fully-async"])


def test_fully_async_launch_example_no_longer_lists_its_async_flags(tmp_path):
    """examples/launch/run-grpo-fully-async.sh --dry-run: --fully-async and --max-staleness are built; what the
    dry run still lists as not supported is outside this mode (weight conversion, health checks)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": "4"}\n')
    env = dict(os.environ, MODEL="qwen3-30B-A3B", DATA=str(data),
               RELAX_TRAIN=f"{sys.executable} -m relax.entrypoints.train")
    proc = subprocess.run(["bash", str(ROOT / "examples" / "launch" / "run-grpo-fully-async.sh"), "--dry-run",
                           "--output-dir", str(tmp_path)], capture_output=True, text=True, env=env, cwd=str(ROOT),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    refused = [line for line in proc.stdout.splitlines() if line.startswith("not supported yet")]
    assert refused and "--fully-async" not in refused[0] and "--max-staleness" not in refused[0], refused
