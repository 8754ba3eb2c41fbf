"""Start-up hook of the CPU SGLang subprocess (this folder is on its PYTHONPATH only).

When SGLang is importable but Triton is not, install the `triton` stand-in of `_relax_triton`
before anything imports Triton (see that module for why this is enough on CPU). With Triton
installed, without SGLang, or with RELAX_SGLANG_TRITON_STUB=0, nothing happens. Cheap: it only
looks up two module specs and imports nothing heavy.
"""

import importlib.util
import os
import sys


def _maybe_install_triton_standin() -> None:
    if os.environ.get("RELAX_SGLANG_TRITON_STUB", "1") == "0" or "triton" in sys.modules:
        return
    if importlib.util.find_spec("triton") is not None or importlib.util.find_spec("sglang") is None:
        return
    import _relax_triton

    _relax_triton.install()


try:
    _maybe_install_triton_standin()
except Exception as exc:  # never break interpreter start-up
    print(f"relax cpu_shims: triton stand-in not installed: {exc!r}", file=sys.stderr)
