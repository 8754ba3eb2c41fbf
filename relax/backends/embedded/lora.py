"""LoRA serving in the embedded engine: the base model plus one active adapter, as SGLang's HTTP API serves them.

- `POST /load_lora_adapter {"lora_name", "lora_path"}` reads a PEFT adapter folder (adapter_config.json +
  adapter_model.safetensors, as Relax's --save-hf writes it with LoRA) and makes it the active adapter;
  `POST /unload_lora_adapter {"lora_name"}` drops it. Answers `{"success", "error_message", "loaded_adapters"}`
  (SGLang's LoadLoRAAdapterReqOutput); the load's answer adds `checksum` (sum of |x| over the adapter's tensors, in
  float64) and `module_checksums` (the same per adapted module) so that a sender can verify what the engine holds.
- `/generate` requests name it as SGLang's do: `"lora_path": name` (or one entry per prompt, None for the base).

One adapter at a time: loading a second name is refused until the first is unloaded (SGLang serves several; the
trainer's sync needs one). The adapter is not merged into the weights: each adapted `nn.Linear` gets a forward hook
adding `alpha / r * B(A(x))` to the rows of the batch whose request names the adapter, so requests naming no
adapter are served by the base, bit for bit, in the same batch. Loads and unloads run on the scheduler thread
between steps (`EmbeddedEngine.call`), so a forward pass never mixes adapters.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from relax.backends.embedded.requests import EngineError

_PREFIX = "base_model.model."


def read_peft(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(adapter_config.json, HF module name -> (A [r, in], B [out, r])) of a PEFT folder."""
    from safetensors.torch import load_file

    folder = Path(path)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        state = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise EngineError(f"lora_path {path}: not a PEFT adapter folder ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise EngineError(f"lora_path {path}: only plain LoRA adapters are served (peft_type LORA, no DoRA/rsLoRA)")
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in state:
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix(_PREFIX).removesuffix(".lora_A.weight")
            b = state.get(key.replace(".lora_A.", ".lora_B."))
            if b is None:
                raise EngineError(f"lora_path {path}: {key} has no lora_B")
            modules[module] = (state[key], b)
    if not modules:
        raise EngineError(f"lora_path {path}: no LoRA tensors in adapter_model.safetensors")
    return config, modules


class LoraServing:
    """The engine's adapter slot (one adapter); its methods other than `check` run on the scheduler thread."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.name: str | None = None
        self.path: str | None = None
        self._hooks: list = []
        self._rows: torch.Tensor | None = None  # [batch] 1.0 where the row's request names the adapter

    def loaded(self) -> dict[str, str]:
        return {self.name: self.path} if self.name is not None else {}

    def check(self, name: Any) -> str | None:
        """The adapter a request's `lora_path` names (None: the base); refused unless it is the loaded one."""
        if name is None:
            return None
        if not isinstance(name, str) or name != self.name:
            raise EngineError(f"lora_path {name!r}: no such adapter is loaded (loaded: {sorted(self.loaded())}); "
                              "load it with /load_lora_adapter first")
        return name

    @torch.no_grad()
    def load(self, name: str, path: str) -> dict[str, Any]:
        if not name or not path:
            raise EngineError("lora_name and lora_path are required")
        if self.name is not None:
            raise EngineError(f"adapter {self.name!r} is loaded: the embedded engine serves one adapter at a time; "
                              "unload it first (/unload_lora_adapter)")
        config, modules = read_peft(path)
        scale = float(config["lora_alpha"]) / float(config["r"])
        hooks, checksum, sums = [], 0.0, {}
        for module_name, (a, b) in sorted(modules.items()):
            try:
                linear = self.model.get_submodule(module_name)
            except AttributeError:
                linear = None
            if not isinstance(linear, torch.nn.Linear) or a.shape[1] != linear.in_features \
                    or b.shape[0] != linear.out_features or a.shape[0] != b.shape[1]:
                for h in hooks:
                    h.remove()
                raise EngineError(f"lora_path {path}: {module_name} is not a linear layer of this model with an "
                                  f"adapter of shape A {tuple(a.shape)}, B {tuple(b.shape)}")
            sums[module_name] = float(a.double().abs().sum() + b.double().abs().sum())
            checksum += sums[module_name]
            w = linear.weight
            hooks.append(linear.register_forward_hook(self._hook(a.to(w.device, w.dtype), b.to(w.device, w.dtype),
                                                                 scale)))
        self._hooks, self.name, self.path = hooks, name, str(path)
        return {"checksum": checksum, "module_checksums": sums, "modules": len(hooks), "rank": int(config["r"])}

    def unload(self, name: str) -> None:
        if name is None or name != self.name:
            raise EngineError(f"lora_name {name!r}: no such adapter is loaded (loaded: {sorted(self.loaded())})")
        for h in self._hooks:
            h.remove()
        self._hooks, self.name, self.path = [], None, None

    def _hook(self, a: torch.Tensor, b: torch.Tensor, scale: float):
        def add_adapter(_module, args, out):
            rows = self._rows
            if rows is None:
                return out  # no row of this pass names the adapter: the base
            delta = F.linear(F.linear(args[0], a), b) * scale
            return out + delta * rows.view(-1, *([1] * (out.dim() - 1))).to(out.dtype)

        return add_adapter

    @contextmanager
    def rows(self, reqs: Sequence):
        """Within the block, the forward pass over `reqs` (one per batch row) applies the adapter to the rows whose
        request names it."""
        if self.name is None or not any(getattr(r, "lora_name", None) for r in reqs):
            yield
            return
        self._rows = torch.tensor([1.0 if r.lora_name == self.name else 0.0 for r in reqs],
                                  device=next(self.model.parameters()).device)
        try:
            yield
        finally:
            self._rows = None


def add_lora_routes(app, engine, read_json) -> None:
    """SGLang's /load_lora_adapter and /unload_lora_adapter on the embedded engine's server."""
    from fastapi import Request  # the server's dependency, not the engine's

    def answer(success: bool, message: str = "", **extra):
        return {"success": success, "error_message": "" if success else message,
                "loaded_adapters": engine.lora.loaded(), **extra}

    async def load_lora_adapter(request):
        body = await read_json(request)
        try:
            res = await asyncio.wrap_future(engine.call(
                lambda: engine.lora.load(body.get("lora_name"), body.get("lora_path")), name="load_lora_adapter"))
        except EngineError as exc:
            return answer(False, str(exc))
        return answer(True, **res)

    async def unload_lora_adapter(request):
        body = await read_json(request)
        try:
            await asyncio.wrap_future(engine.call(lambda: engine.lora.unload(body.get("lora_name")),
                                                  name="unload_lora_adapter"))
        except EngineError as exc:
            return answer(False, str(exc))
        return answer(True)

    # FastAPI reads a handler's parameter types from its annotations: objects here, since this module's are strings
    for path, handler in (("/load_lora_adapter", load_lora_adapter), ("/unload_lora_adapter", unload_lora_adapter)):
        handler.__annotations__ = {"request": Request}
        app.post(path)(handler)
