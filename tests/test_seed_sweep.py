"""benchmarks/seed_sweep.py reads finished runs: the 5-step-mean crossing, the final reward and the spread."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("seed_sweep", ROOT / "benchmarks" / "seed_sweep.py")
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)


def test_crossing_step_uses_the_trailing_five_step_mean():
    assert sweep.crossing_step([1.0] * 4, 0.8) is None  # fewer than 5 steps
    assert sweep.crossing_step([0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], 0.8) == 6
    assert sweep.crossing_step([0.9] * 5, 0.8) == 4
    assert sweep.crossing_step([0.8] * 10, 0.8) is None  # strictly above


def _write(folder, rewards):
    folder.mkdir(parents=True)
    with (folder / "metrics.jsonl").open("w") as f:
        for i, r in enumerate(rewards):
            f.write(json.dumps({"step": i, "rollout/reward_mean": r, "rollout/reward_std": 0.3,
                                "rollout/num_samples": 512.0, "rollout/num_groups": 32.0,
                                "train/approx_kl": 0.01 * i, "train/entropy": 1.0}) + "\n")


def test_summary_table_and_exit_status(tmp_path, capsys):
    _write(tmp_path / "seed_1", [0.1] * 5 + [0.9] * 15)
    _write(tmp_path / "seed_2", [0.1] * 20)
    status = sweep.summarise([1, 2], 20, 0.8, tmp_path, {1: 12.5})
    out = capsys.readouterr().out
    assert status == 1
    assert "| 1 | 9 | 0.900 / 0.900 | 0.190 | 0 | 12.5 |" in out
    assert "| 2 | never (20 steps) |" in out
    assert "min 9, median 14.5, max 20; not crossing: [2]" in out
