"""transformers' index of its model modules kept in a file (relax.transformers_index): the same index as
transformers builds, read back instead of rebuilt, rebuilt when a file changes, and transformers' own build
whenever the file cannot be written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax import transformers_index


def _models_folder() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("transformers").origin).parent / "models"


def _counting(build):
    calls = []

    def counted(module_path, prefix=None):
        calls.append(str(module_path))
        return build(module_path, prefix)

    return counted, calls


def test_the_kept_index_equals_transformers_own_and_is_read_back(tmp_path):
    from transformers.utils.import_utils import create_import_structure_from_path, spread_import_structure

    def build(module_path, prefix=None):  # transformers' index without its in-process cache
        spread = spread_import_structure(create_import_structure_from_path(module_path))
        return {k: {f"{prefix}.{m}": v for m, v in d.items()} for k, d in spread.items()} if prefix else spread

    counted, calls = _counting(build)
    cached = transformers_index.cached(counted, str(tmp_path))
    first = cached(_models_folder(), prefix="models")
    second = cached(_models_folder(), prefix="models")
    assert len(calls) == 1  # the second came from the file
    assert first == second == build(_models_folder(), prefix="models")
    assert list(first) == list(second)  # the order of the backends' groups too
    assert "models.qwen2.modeling_qwen2" in second[frozenset({"torch"})]
    assert len(list(tmp_path.glob("*.json"))) == 1


def _package(root: Path) -> Path:
    folder = root / "pkg" / "sub"
    folder.mkdir(parents=True)
    (folder / "one.py").write_text("__all__ = ['A']\nclass A: pass\n")
    return root / "pkg"


def test_a_changed_file_rebuilds_the_index(tmp_path):
    package = _package(tmp_path)
    counted, calls = _counting(lambda module_path, prefix=None: {frozenset(): {"sub.one": {"A"}}})
    cached = transformers_index.cached(counted, str(tmp_path / "cache"))
    cached(package)
    cached(package)
    assert len(calls) == 1
    changed = package / "sub" / "one.py"
    changed.write_text("__all__ = ['A', 'B']\nclass A: pass\nclass B: pass\n")
    os.utime(changed, ns=(1, 1))  # a new size and time
    cached(package)
    assert len(calls) == 2
    (package / "sub" / "two.py").write_text("")
    cached(package)
    assert len(calls) == 3


def test_an_unwritable_cache_leaves_transformers_to_build(tmp_path):
    package = _package(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache folder should be
    counted, calls = _counting(lambda module_path, prefix=None: {frozenset(): {"sub.one": {"A"}}})
    cached = transformers_index.cached(counted, str(blocker / "cache"))
    assert cached(package) == {frozenset(): {"sub.one": {"A"}}}
    assert cached(package) == {frozenset(): {"sub.one": {"A"}}}
    assert len(calls) == 2


def test_a_damaged_file_is_rebuilt(tmp_path):
    package = _package(tmp_path)
    counted, calls = _counting(lambda module_path, prefix=None: {frozenset({"torch"}): {"sub.one": {"A"}}})
    cached = transformers_index.cached(counted, str(tmp_path / "cache"))
    cached(package)
    (kept,) = (tmp_path / "cache").glob("*.json")
    for damaged in ("[[", '[[["torch"], ["sub.one"]]]', "[1]"):  # cut short, or JSON of another shape
        kept.write_text(damaged)
        assert cached(package) == {frozenset({"torch"}): {"sub.one": {"A"}}}
    assert len(calls) == 4


_IMPORT = """
import relax, transformers
from transformers.utils import import_utils
from transformers import AutoConfig
print("WRAPPED", hasattr(import_utils.define_import_structure, "kept_in"), AutoConfig.__name__)
"""


@pytest.mark.parametrize("setting", ["", "off"])
def test_a_process_importing_relax_keeps_the_index(tmp_path, setting):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), transformers_index.ENV: setting}
    runs = [subprocess.run([sys.executable, "-c", _IMPORT], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    for out in runs:
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"WRAPPED {setting != 'off'} AutoConfig" in out.stdout
    kept = list((tmp_path / "relax" / "transformers-index").glob("*.json"))
    assert len(kept) == (0 if setting == "off" else 1)
