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


def _maybe_drop_pin_memory() -> None:
    """SGLang 0.5.23's LoRA layers and its torch_native LoRA backend allocate their small index tensors with
    `pin_memory=True` (torch.tensor/empty(..., pin_memory=True), Tensor.pin_memory()), which a CPU-only torch refuses
    ("pin_memory=True requires a CUDA or other accelerator backend"), so `--enable-lora` cannot start on CPU. Pinning
    only speeds up host-to-GPU copies; on CPU the tensors are used where they are. With RELAX_SGLANG_NO_PIN_MEMORY=1
    (set by SGLangServerProcess for a CPU server with LoRA enabled) and no accelerator, pinning becomes a no-op."""
    if os.environ.get("RELAX_SGLANG_NO_PIN_MEMORY") != "1":
        return
    import functools

    import torch

    if torch.cuda.is_available():
        return
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

    def unpinned(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        return call

    for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like",
                 "as_tensor", "empty_strided"):
        setattr(torch, name, unpinned(getattr(torch, name)))


try:
    _maybe_drop_pin_memory()
except Exception as exc:  # never break interpreter start-up
    print(f"relax cpu_shims: pin_memory left as is: {exc!r}", file=sys.stderr)
