"""A malformed prompt line stops the run naming file and line, unless --skip-bad-lines counts it."""

import pytest

from relax.config import parse_config
from relax.rollout.data_source import PromptDataError, PromptDataSource


def _config(path, *extra):
    return parse_config(["--output-dir", "/tmp/relax-bad-lines", "--hf-checkpoint", "/m", "--prompt-data", str(path),
                         "--rollout-batch-size", "1", "--num-rollout", "1", *extra])


def test_bad_line_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"input": "a", "label": "1"}\n{not json\n{"input": "b", "label": "2"}\n')
    with pytest.raises(PromptDataError) as info:
        PromptDataSource.from_args(_config(path)).get_batch(3)
    assert f"{path}:2" in str(info.value)


def test_skip_bad_lines_counts_them(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"input": "a", "label": "1"}\n{not json\n{"label": "no input"}\n{"input": "b", "label": "2"}\n')
    source = PromptDataSource.from_args(_config(path, "--skip-bad-lines"))
    records = source.get_batch(2)
    assert [r.prompt for r in records] == ["a", "b"]
    assert source.stats()["bad_lines"] == 2
