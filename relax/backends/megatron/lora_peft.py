"""LoRA adapters <-> PEFT's format (adapter_config.json + adapter_model.safetensors, HF module names).

Megatron fuses HF's q/k/v projections into `linear_qkv` and gate/up into `linear_fc1`, with one adapter each:
delta = B @ A with B spanning the fused rows. PEFT adapts each HF projection on its own. The fused adapter is the
same change as one adapter per projection that shares A and takes its own rows of B (delta_q = B_q @ A), so the
export is exact. Loading back needs that shape: the q, k and v (gate and up) adapters of a layer must share A,
which PEFT adapters trained elsewhere in general do not (refused, naming the layer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from relax.formats.hf_names import layer_hf_names
from relax.formats.model_arch import ModelArch
from relax.backends.megatron.hf_weights import fuse_qkv, split_qkv
from relax.backends.megatron.lora import adapter_tensors

__all__ = ["peft_tensors", "peft_config", "ADAPTER_FILE", "CONFIG_FILE", "load_peft_state"]

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_PREFIX = "base_model.model."  # PeftModel's prefix of the HF model's names


def _hf_modules(arch: ModelArch, layer: int, suffix: str) -> tuple[str, list[str]]:
    """(kind, HF module names) of a Megatron linear (suffix like "self_attention.linear_qkv")."""
    kind, names = layer_hf_names(layer, suffix + ".weight", arch)
    return kind, [n.removesuffix(".weight") for n in names]


def _split_b(arch: ModelArch, kind: str, b: torch.Tensor) -> list[torch.Tensor]:
    if kind == "qkv":
        return list(split_qkv(arch, b))
    if kind == "fc1":  # [gate; up]
        return list(b.chunk(2, dim=0))
    return [b]


def _megatron_linears(gpt: torch.nn.Module) -> list[tuple[str, int, str]]:
    """(module name, global layer, suffix) of each adapted linear of this stage."""
    out = []
    for name, module in gpt.named_modules():
        if hasattr(module, "lora_A"):
            local = int(name.split(".")[2])  # decoder.layers.<i>.<suffix>
            out.append((name, gpt.decoder.layers[local].layer_number - 1, name.split(".", 3)[3]))
    return out


def peft_tensors(gpt: torch.nn.Module, arch: ModelArch) -> list[tuple[str, torch.Tensor]]:
    """This stage's adapters in PEFT's names (full tensors; collective over the tensor-parallel group)."""
    full = adapter_tensors(gpt)
    out = []
    for name, layer, suffix in _megatron_linears(gpt):
        kind, modules = _hf_modules(arch, layer, suffix)
        a, b = full[name + ".lora_A"], full[name + ".lora_B"]
        for module, part in zip(modules, _split_b(arch, kind, b)):
            out.append((f"{_PREFIX}{module}.lora_A.weight", a.clone().contiguous()))
            out.append((f"{_PREFIX}{module}.lora_B.weight", part.contiguous()))
    return out


def peft_config(gpt: torch.nn.Module, arch: ModelArch, settings: Any, base: str | None) -> dict[str, Any]:
    """adapter_config.json of the adapters of `gpt` (`settings`: its LoraSettings; `base`: --hf-checkpoint)."""
    targets = sorted({m.rsplit(".", 1)[1] for _, layer, suffix in _megatron_linears(gpt)
                      for m in _hf_modules(arch, layer, suffix)[1]})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": settings.rank,
            "lora_alpha": settings.alpha, "lora_dropout": settings.dropout, "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}


def write_config(folder: str | Path, config: dict[str, Any]) -> None:
    (Path(folder) / CONFIG_FILE).write_text(json.dumps(config, indent=1))


def load_peft_state(gpt: torch.nn.Module, arch: ModelArch, folder: str | Path) -> dict[str, torch.Tensor]:
    """The adapters of a PEFT folder as this rank's Megatron adapter tensors (module name + ".lora_A"/".lora_B",
    this rank's TP shard). Raises if its rank or targets differ from the model's, or fused projections' adapters
    do not share A."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / CONFIG_FILE).read_text())
    state = load_file(str(folder / ADAPTER_FILE))
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    out = {}
    for name, layer, suffix in _megatron_linears(gpt):
        kind, modules = _hf_modules(arch, layer, suffix)
        keys = [(f"{_PREFIX}{m}.lora_A.weight", f"{_PREFIX}{m}.lora_B.weight") for m in modules]
        missing = [k for pair in keys for k in pair if k not in state]
        if missing:
            raise KeyError(f"{folder}: no adapter for {missing[0]} (its target_modules {config.get('target_modules')} "
                           "do not cover this run's --lora-target-modules)")
        a = state[keys[0][0]]
        if any(not torch.equal(state[ka], a) for ka, _ in keys[1:]):
            raise ValueError(f"{folder}: the adapters of {', '.join(modules)} do not share A, so they are not one "
                             f"Megatron adapter of {suffix} (layer {layer})")
        bs = [state[kb] for _, kb in keys]
        module = gpt.get_submodule(name)
        column = getattr(module.lora_B, "tensor_model_parallel", False)
        if kind == "qkv":
            b = fuse_qkv(arch, *bs)
        elif kind == "fc1" and column and tp > 1:  # each rank holds [its gate rows; its up rows]
            b = torch.cat([bs[0].chunk(tp)[rank], bs[1].chunk(tp)[rank]], dim=0)
        else:
            b = torch.cat(bs, dim=0)
        if column and not (kind == "fc1" and tp > 1):
            b = b.chunk(tp, dim=0)[rank]
        if not column and tp > 1:
            a = a.chunk(tp, dim=1)[rank]
        out[name + ".lora_A"], out[name + ".lora_B"] = a, b
    return out


def peft_snapshot(trainer: Any) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """(PEFT-named CPU tensors, adapter_config.json without its base) of a LoRA `MegatronTrainer`, for --save-hf
    (collective over the tensor-parallel group). One file per adapter: refused with pipeline parallelism."""
    from relax.backends.megatron.hf_weights import unwrap_model

    if trainer.layout.pp > 1:
        raise NotImplementedError("--save-hf with --lora-rank and pipeline parallelism is not supported yet (a PEFT "
                                  "adapter is one file)")
    if trainer.settings.lora.modules_to_save:
        raise NotImplementedError("a PEFT adapter (--save-hf, adapter-only sync) with --lora-modules-to-save is not "
                                  "supported yet: it would lack the trained head; use --lora-merge-sync and --save")
    gpt = unwrap_model(trainer.model)
    return peft_tensors(gpt, trainer.arch), peft_config(gpt, trainer.arch, trainer.settings.lora, None)
