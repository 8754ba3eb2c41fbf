"""The embedded default's assets are built once per key into the user cache and copied into each run
(issue 18, start-up): a second build is a cache hit that runs no builder and gives the same bytes. The
builder is replaced by a fast fake (the real warm start takes seconds to minutes on a loaded CPU); the real
one is exercised by every embedded-default run and tests/test_tasks_tiny.py."""

import hashlib
import json
import subprocess
import sys

import pytest

import relax.models.embedded as emb


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _fake_build(model_dir, data_path, seed):
    model_dir.mkdir(parents=True)
    (model_dir / "model.safetensors").write_bytes(bytes([seed]) * 64)
    (model_dir / "config.json").write_text(json.dumps({"seed": seed}))
    data_path.write_text(json.dumps({"input": "1", "label": "2"}) + "\n")
    return {"steps": emb.WARM_START_STEPS, "seed": seed}


def test_second_build_hits_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(emb.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(emb, "_build", _fake_build)
    first = emb.build_embedded_assets(str(tmp_path / "a" / "model"), str(tmp_path / "a" / "train.jsonl"), seed=3)
    assert first["cache"] == "miss" and not first["reused"]
    assert first["cache_dir"].endswith(emb.cache_key(3))

    def boom(*a, **k):
        raise AssertionError("a cache hit must not build")

    monkeypatch.setattr(emb, "_build", boom)
    second = emb.build_embedded_assets(str(tmp_path / "b" / "model"), str(tmp_path / "b" / "train.jsonl"), seed=3)
    assert second["cache"] == "hit" and second["cache_dir"] == first["cache_dir"]
    assert _digest(tmp_path / "a" / "model") == _digest(tmp_path / "b" / "model")
    assert (tmp_path / "a" / "train.jsonl").read_bytes() == (tmp_path / "b" / "train.jsonl").read_bytes()
    assert second["warm_start"]["steps"] == emb.WARM_START_STEPS
    # The run folder is self-contained: a copy, not a link into the cache.
    assert not (tmp_path / "b" / "model").is_symlink()
    # The same run folder again: reused in place.
    assert emb.build_embedded_assets(str(tmp_path / "b" / "model"), str(tmp_path / "b" / "train.jsonl"),
                                     seed=3)["reused"]
    with pytest.raises(AssertionError):  # another seed is another key: it would build
        emb.build_embedded_assets(str(tmp_path / "c" / "model"), str(tmp_path / "c" / "train.jsonl"), seed=4)


def test_key_depends_on_seed_and_cache_can_be_turned_off(tmp_path, monkeypatch):
    assert emb.cache_key(1) != emb.cache_key(2)
    assert emb.cache_key(1) == emb.cache_key(1)
    monkeypatch.setenv(emb.CACHE_ENV, "off")
    assert emb.cache_root() is None
    monkeypatch.setattr(emb, "_build", _fake_build)
    out = emb.build_embedded_assets(str(tmp_path / "m"), str(tmp_path / "t.jsonl"), seed=1)
    assert out["cache"] == "off" and out["warm_start"]["seed"] == 1
    assert json.loads((tmp_path / "m" / "relax_embedded.json").read_text())["seed"] == 1


def test_cache_key_does_not_import_torch():
    """The key is computed on the launch's serial path, before Ray starts: torch's import (seconds of CPU) must
    not happen there (the controller imports it on a thread meanwhile, relax.core.run)."""
    code = ("import sys; from relax.models.embedded import cache_key; cache_key(1); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
