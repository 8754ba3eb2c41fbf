"""`--megatron-to-hf-mode`: one converter interface for HF <-> Megatron weights, two implementations.

- `raw` (`RawConverter`): Relax's own mapping in `relax.backends.megatron.hf_weights` (Llama / Qwen2 / GLM4 / Nemotron /
  Qwen3 / Qwen2-MoE / Qwen3-MoE, local and Transformer Engine specs, TP/PP aware).
- `bridge` (`BridgeConverter`): NVIDIA Megatron-Bridge's `megatron.bridge.AutoBridge`:
  `AutoBridge.from_hf_pretrained(hf_path)` reads the HF config, `bridge.load_hf_weights(models, hf_path)`
  loads an HF folder into the Megatron model chunks and `bridge.export_hf_weights(models, cpu=True)` yields
  `(hf_name, tensor)` pairs gathered over tensor/pipeline parallel ranks.

No Megatron-Bridge release installs beside this project's pins: PyPI's megatron-bridge 0.3.0 and 0.3.1 (every
release) require transformers<5.0.0 and transformer-engine[core_cu13,pytorch]<2.13 (relax.config.support_deps
records what was checked). So a run with `--megatron-to-hf-mode bridge` stops before Ray with that dependency
conflict and the fix (--megatron-to-hf-mode raw); `check_bridge_mode` and `BridgeConverter` say the same where
the package is absent, and where it imports (its own environment) `BridgeConverter` converts through it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Iterator, Optional

import torch

from relax.backends.megatron.hf_weights import export_hf_weights, load_hf_checkpoint_dir, load_hf_weights
from relax.config.errors import ConfigError
from relax.config.support_deps import MEGATRON_BRIDGE_CONFLICT, MEGATRON_BRIDGE_FIX

# What installing it takes, and why that is not possible beside Relax's pins
INSTALL_HINT = (f"pip install megatron-bridge cannot keep Relax's pins: {MEGATRON_BRIDGE_CONFLICT}; "
                f"{MEGATRON_BRIDGE_FIX}")
MODES = ("raw", "bridge")

_STATUS: dict[str, Optional[str]] = {}


def bridge_unavailable_reason() -> Optional[str]:
    """None when `megatron.bridge.AutoBridge` imports in this environment, else why it does not."""
    if "bridge" not in _STATUS:
        try:
            if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
                _STATUS["bridge"] = "the package megatron.bridge is not installed"
            else:
                getattr(importlib.import_module("megatron.bridge"), "AutoBridge")
                _STATUS["bridge"] = None
        except Exception as exc:  # installed but broken (e.g. no Transformer Engine): say what failed
            _STATUS["bridge"] = f"importing megatron.bridge fails: {type(exc).__name__}: {exc}"
    return _STATUS["bridge"]


def check_bridge_mode(v: dict, explicit=None) -> None:
    """`--megatron-to-hf-mode bridge` needs an importable Megatron-Bridge (a rule over config values)."""
    if v.get("megatron_to_hf_mode", "raw") != "bridge":
        return
    why = bridge_unavailable_reason()
    if why:
        raise ConfigError(f"--megatron-to-hf-mode bridge converts weights with Megatron-Bridge, but {why}: "
                          f"{MEGATRON_BRIDGE_CONFLICT}; {MEGATRON_BRIDGE_FIX}")


def _chunks(model: Any) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


class RawConverter:
    """Relax's own mapping (`hf_weights`); needs the run's `ModelArch`."""

    mode = "raw"

    def __init__(self, arch, hf_path: Optional[str] = None):
        self.arch, self.hf_path = arch, hf_path

    def load(self, model: Any, hf_path: Optional[str] = None) -> None:
        for chunk in _chunks(model):
            load_hf_weights(chunk, self.arch, load_hf_checkpoint_dir(hf_path or self.hf_path))

    def export(self, model: Any, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        for chunk in _chunks(model):
            yield from export_hf_weights(chunk, self.arch, dtype=dtype)


class BridgeConverter:
    """Megatron-Bridge's AutoBridge for the HF folder `hf_path` (config and, for `load`, weights)."""

    mode = "bridge"

    def __init__(self, arch=None, hf_path: Optional[str] = None):
        why = bridge_unavailable_reason()
        if why:
            raise RuntimeError(f"--megatron-to-hf-mode bridge: {why}; {INSTALL_HINT}")
        if not hf_path:
            raise ValueError("--megatron-to-hf-mode bridge needs --hf-checkpoint (AutoBridge reads its config)")
        from megatron.bridge import AutoBridge

        self.arch, self.hf_path = arch, hf_path
        self.bridge = AutoBridge.from_hf_pretrained(hf_path)

    def load(self, model: Any, hf_path: Optional[str] = None) -> None:
        self.bridge.load_hf_weights(_chunks(model), hf_path or self.hf_path)

    def export(self, model: Any, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.bridge.export_hf_weights(_chunks(model), cpu=True, show_progress=False):
            tensor = tensor.detach()
            yield name, tensor.to(dtype) if dtype is not None and tensor.dtype != dtype else tensor


def make_converter(mode: str, arch=None, hf_path: Optional[str] = None):
    """The converter of `--megatron-to-hf-mode` (`raw` or `bridge`)."""
    if mode == "raw":
        return RawConverter(arch, hf_path)
    if mode == "bridge":
        return BridgeConverter(arch, hf_path)
    raise ValueError(f"unknown --megatron-to-hf-mode {mode!r}; one of {MODES}")
