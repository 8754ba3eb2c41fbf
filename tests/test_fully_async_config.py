"""Parse-time rules of --fully-async (relax.config.validate): --balance-data is accepted with a warning that
says what it does there; --colocate is refused naming both flags; --max-staleness needs --fully-async."""

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


def test_streaming_chunks_stay_refused():
    config = parse_config(BASE + ["--fully-async", "--num-iters-per-train-update", "2"])
    assert [f for f in unsupported_flags(config)] == ["--num-iters-per-train-update"]


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
