"""`relax-train --version` prints the installed package's version before anything heavy is imported, and a run's
console starts with one banner line: version, mode, model, rollout engines and output folder
(relax/entrypoints/train.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from conftest import ROOT, relax_cli
from relax.config import parse_config
from relax.entrypoints.train import banner

VERSION = metadata.version("relax")


def test_version_prints_the_package_version_and_imports_nothing_heavy():
    script = Path(sys.executable).with_name("relax-train")
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert proc.returncode == 0 and proc.stdout == f"relax {VERSION}\n" and proc.stderr == "", proc
    probe = ("import sys; from relax.entrypoints.train import main; code = main(['--output-dir', '/nonexistent', "
             "'--version']); heavy = [m for m in ('torch', 'ray', 'megatron', 'transformers', 'relax.config') "
             "if m in sys.modules]; print(code, heavy)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert proc.stdout.splitlines() == [f"relax {VERSION}", "0 []"], proc


def test_the_banner_is_the_first_console_line(tmp_path, tiny_model):
    """On a run that stops in its checks before Ray (the quickest real start): the banner, then the error."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"input": [{"role": "user", "content": "1"}], "label": "2"}) + "\n")
    out = tmp_path / "out"
    proc = relax_cli("--hf-checkpoint", tiny_model, "--prompt-data", str(data), "--input-key", "input",
                     "--rm-type", "exact_match", "--rollout-batch-size", "1", "--num-rollout", "1",
                     "--output-dir", str(out))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert lines[0].endswith(f"relax INFO relax {VERSION} | sync | model: {tiny_model} | rollout: 1 engine "
                             f"(embedded) | output: {out}"), lines
    assert " ERROR --prompt-data: " in lines[1] and len(lines) == 2, lines


def test_banner_fields(tmp_path, tiny_model, prompt_file):
    embedded = parse_config(["--output-dir", str(tmp_path / "e")])
    assert banner(embedded) == (f"relax {VERSION} | sync | model: embedded tiny model ({tmp_path}/e/embedded/model) "
                                f"| rollout: 1 engine (embedded) | output: {tmp_path}/e")
    own = parse_config(["--hf-checkpoint", tiny_model, "--prompt-data", prompt_file, "--rollout-batch-size", "2",
                        "--num-rollout", "1", "--fully-async",
                        "--max-staleness", "2", "--rollout-external", "--rollout-external-engine-addrs",
                        "127.0.0.1:1", "127.0.0.1:2", "--output-dir", str(tmp_path / "o")])
    assert banner(own) == (f"relax {VERSION} | fully-async (max staleness 2) | model: {tiny_model} | rollout: "
                           f"2 engines (external) | output: {tmp_path}/o")
