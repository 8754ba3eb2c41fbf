"""relax.heap: in a process that imports Relax, torch's import leaves its objects in the collector's permanent
generation and the collector enabled; `collector_paused` restores the collector's state whatever happens."""

import gc
import subprocess
import sys

import pytest

from relax.heap import collector_paused


def test_torch_imported_after_relax_is_frozen_and_collection_goes_on():
    code = ("import gc, relax, sys; assert 'torch' not in sys.modules; before = gc.get_freeze_count(); "
            "import torch; print(before, gc.get_freeze_count(), gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    before, after, enabled = int(out[0]), int(out[1]), out[2]
    assert after > before + 50_000 and enabled == "True"  # torch alone is ~100k objects


def test_collector_paused_restores_state():
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with collector_paused():
            assert not gc.isenabled()
            raise ValueError("import failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller that disabled it keeps it disabled
    finally:
        gc.enable()
