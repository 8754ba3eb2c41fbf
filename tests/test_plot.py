"""`relax-plot`: PNGs from a real run's metrics.jsonl (tests/data/run_metrics.jsonl: 3 steps of the embedded
default, `relax-train --num-rollout 3`), and errors that name the file and line of a bad metrics.jsonl."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from relax.entrypoints.plot import main
from relax.observability.plot import (VIEWS, MetricsFileError, load_records, plot_run, series,
                                      step_time_breakdown)

FIXTURE = Path(__file__).parent / "data" / "run_metrics.jsonl"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURE, run / "metrics.jsonl")
    return run


def _is_png_with_content(path: Path) -> bool:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    pixels = imread(path)
    return pixels.shape[0] > 100 and pixels.shape[1] > 100 and float(pixels.std()) > 0.01  # not a blank image


def test_every_view_of_a_real_run(run_dir):
    written, notes = plot_run(run_dir)
    assert notes == []
    names = sorted(p.name for p in written)
    assert names == sorted([f"{stem}.png" for stem in VIEWS] + ["overview.png"])
    for path in written:
        assert path.parent == run_dir / "plots"
        assert _is_png_with_content(path)


def test_step_time_breakdown_adds_up_to_the_step_time():
    records, _ = load_records(FIXTURE)
    steps, phases = step_time_breakdown(records)
    assert steps == [0, 1, 2]
    for i, record in enumerate(records):
        total = sum(seconds[i] for seconds in phases.values())
        assert total == pytest.approx(record["perf/step_time"])
        assert phases["rollout"][i] == pytest.approx(record["perf/rollout_time"])
        assert phases["other"][i] >= 0


def test_list_valued_metrics_plot_as_their_mean_and_missing_views_are_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "rollout/reward_mean": 0.1 * s,
                                        "rollout/response_len_mean": [1, 2, 3 + s]}) + "\n" for s in range(3)))
    assert series(load_records(path)[0], "rollout/response_len_mean") == ([0, 1, 2], [2.0, 2 + 1 / 3, 2 + 2 / 3])
    written, notes = plot_run(tmp_path, tmp_path / "out")
    assert sorted(p.name for p in written) == ["overview.png", "response_length.png", "reward.png"]
    assert any(n.startswith("kl.png: skipped") for n in notes) and any("step_time.png" in n for n in notes)


@pytest.mark.parametrize("content, expected", [
    (None, "metrics.jsonl: not found"),
    ("", "metrics.jsonl: empty"),
    ("\n\n", "metrics.jsonl: empty"),
    ('{"step": 0, "a": 1}\n{"step": 1, "a": \n{"step": 2}\n', "metrics.jsonl:2: not valid JSON"),
    ('{"step": 0}\n[1, 2]\n', "metrics.jsonl:2: expected a JSON object with an integer \"step\""),
    ('{"a": 1}\n', "metrics.jsonl:1: expected a JSON object with an integer \"step\""),
])
def test_bad_metrics_files_name_file_and_line(tmp_path, capsys, content, expected):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(MetricsFileError, match=expected.replace("[", r"\[")):
        plot_run(tmp_path)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("relax-plot: error: ") and str(tmp_path / expected.split(":")[0]) in err


def test_a_last_line_being_written_is_skipped_with_a_note(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(FIXTURE.read_text() + '{"step": 3, "rollout/rew')
    assert main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "metrics.jsonl:4: skipped an incomplete last line" in captured.err
    assert (tmp_path / "plots" / "overview.png").exists()
    assert str(tmp_path / "plots" / "reward.png") in captured.out.splitlines()


def test_console_script(run_dir, tmp_path):
    """The installed `relax-plot` (setup.py console_scripts) with --out."""
    script = Path(sys.executable).parent / "relax-plot"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "relax.entrypoints.plot"]
    result = subprocess.run([*cmd, str(run_dir / "metrics.jsonl"), "--out", str(tmp_path / "pngs")],
                            capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "pngs" / "step_time.png").exists() and (tmp_path / "pngs" / "kl.png").exists()
