"""LoRA adapters on Megatron-core's tensor-parallel linears (--lora-rank; docs/lora.md).

Each targeted linear keeps its weight W (frozen) and gains two parameters, `lora_A` [r, in] and `lora_B` [out, r],
as attributes of the same module, so every base parameter keeps its Megatron name (the HF weight mapping, the
checkpoints and the reference copies stay as they are). A forward hook adds `alpha / r * B(A(dropout(x)))` to the
layer's output, as PEFT does.

Tensor parallelism, laid out so that the TP ranks together compute exactly what one rank would:
- column-parallel (linear_qkv, linear_fc1; W split on its output dim): A replicated, B split like W's rows. The
  rank-r activation h = x A^T enters the tensor-parallel region the way the layer's own input does
  (`copy_to_tensor_model_parallel_region`: backward all-reduces h's gradient, so A's gradient and x's are complete
  on every rank); under sequence parallelism h is all-gathered over the sequence like the layer's input, and A's
  gradient (a partial sum over this rank's tokens) is all-reduced by Megatron's finalize_model_grads, which does
  that for every parameter marked `sequence_parallel`.
- row-parallel (linear_proj, linear_fc2; W split on its input dim): A split like W's columns, B replicated. The
  partial h of each rank is summed as the layer sums its output (all-reduce, or reduce-scatter over the sequence
  under sequence parallelism), on r numbers per token instead of the layer's full width; B's gradient then needs
  the sequence-parallel all-reduce too.
Adapters are initialised from the global layer number and the seed, identically for any TP size (a split A is cut
from the full one), so a TP 2 run equals a TP 1 run.

Only the adapters (a critic's value head, and the modules of --lora-modules-to-save, PEFT's modules_to_save: the LM
head) train: everything else is frozen before Megatron's DDP wrapper and optimizer are built, so its grad buffers,
the optimizer's state and grad clipping see only them.
"""

from __future__ import annotations

import math
import re
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from relax.config.rules_lora import COLUMN_TARGETS, LORA_TARGETS, ROW_TARGETS

__all__ = ["LoraSettings", "add_adapters", "has_adapters", "is_adapter_param", "merged_weight",
           "checkpoint_state", "load_checkpoint_state", "adapter_tensors"]

_LINEAR_RE = re.compile(r"^decoder\.layers\.(\d+)\.(?:self_attention|mlp)\.(linear_qkv|linear_proj|linear_fc1|linear_fc2)$")


@dataclass(frozen=True)
class LoraSettings:
    """The adapters of a trainer's model (--lora-*)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS
    init: str = "kaiming"  # kaiming | gaussian (A); B is zero
    seed: int = 1234
    modules_to_save: tuple[str, ...] = ()  # trained in full beside the adapters (PEFT's modules_to_save)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def is_adapter_param(param: torch.Tensor) -> bool:
    return bool(getattr(param, "relax_lora", False))


def is_saved_module_param(param: torch.Tensor) -> bool:
    """A parameter of a module trained in full beside the adapters (--lora-modules-to-save)."""
    return bool(getattr(param, "relax_lora_saved", False))


def has_adapters(model: torch.nn.Module) -> bool:
    return any(is_adapter_param(p) for p in model.parameters())


def _init_a(shape: tuple[int, int], settings: LoraSettings, key: str) -> torch.Tensor:
    """The full A of the layer `key`, the same on every rank and for any TP size."""
    gen = torch.Generator().manual_seed((settings.seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))
    a = torch.empty(shape)
    if settings.init == "gaussian":  # PEFT's init_lora_weights="gaussian"
        return a.normal_(0.0, 1.0 / settings.rank, generator=gen)
    # PEFT's default: nn.init.kaiming_uniform_(a=sqrt(5)) on [r, in], i.e. U(-1/sqrt(in), 1/sqrt(in))
    bound = 1.0 / math.sqrt(shape[1])
    return a.uniform_(-bound, bound, generator=gen)


def _column_hook(module, args, output):
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

    h = F.linear(module.lora_dropout(args[0]), module.lora_A)
    h = gather_from_sequence_parallel_region(h) if module.sequence_parallel else copy_to_tensor_model_parallel_region(h)
    out, bias = output
    return out + F.linear(h, module.lora_B) * module.lora_scale, bias


def _row_hook(module, args, output):
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region

    h = F.linear(module.lora_dropout(args[0]), module.lora_A)
    h = reduce_scatter_to_sequence_parallel_region(h) if module.sequence_parallel else \
        reduce_from_tensor_model_parallel_region(h)
    out, bias = output
    return out + F.linear(h, module.lora_B) * module.lora_scale, bias


def _attach(module, key: str, settings: LoraSettings, column: bool, tp: int, tp_rank: int) -> None:
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    weight = module.weight
    out_local, in_local = weight.shape
    make = dict(device=weight.device, dtype=weight.dtype)
    r = settings.rank
    if column:
        a = _init_a((r, in_local), settings, key)
        b = torch.zeros(out_local, r)
    else:
        a = _init_a((r, in_local * tp), settings, key).chunk(tp, dim=1)[tp_rank].contiguous()
        b = torch.zeros(out_local, r)
    module.lora_A = torch.nn.Parameter(a.to(**make))
    module.lora_B = torch.nn.Parameter(b.to(**make))
    split, replicated = (module.lora_B, module.lora_A) if column else (module.lora_A, module.lora_B)
    set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
    # a replicated adapter under sequence parallelism sees only this rank's tokens: Megatron all-reduces its grad
    replicated.sequence_parallel = bool(module.sequence_parallel)
    for p in (module.lora_A, module.lora_B):
        p.relax_lora = True
    module.lora_scale = settings.scale
    module.lora_dropout = torch.nn.Dropout(settings.dropout) if settings.dropout > 0 else torch.nn.Identity()
    weight.relax_lora_module = weakref.ref(module)  # for merged_weight (the export of merged weights)
    module.register_forward_hook(_column_hook if column else _row_hook)


def add_adapters(gpt: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """Attach adapters to `settings.targets` of this rank's layers and freeze everything else (a critic's value
    head stays trainable). Returns the adapted modules' names."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from relax.backends.megatron.model import is_value_head_param

    if settings.rank <= 0:
        raise ValueError(f"LoRA rank must be > 0, not {settings.rank}")
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    done, seen = [], set()
    for name, module in list(gpt.named_modules()):
        match = _LINEAR_RE.match(name)
        if match is None or match.group(2) not in settings.targets:
            continue
        kind = match.group(2)
        wanted = ColumnParallelLinear if kind in COLUMN_TARGETS else RowParallelLinear
        if type(module) is not wanted:  # TE's fused LayerNorm linears take the norm's input: not built
            raise NotImplementedError(f"LoRA on {type(module).__name__} ({name}) is not supported yet: only "
                                      f"Megatron-core's {wanted.__name__} (the local layer spec); use "
                                      "--transformer-impl local")
        if kind in COLUMN_TARGETS and module.gather_output:
            raise NotImplementedError(f"LoRA on {name}: a column-parallel linear that gathers its output")
        layer = gpt.decoder.layers[int(match.group(1))].layer_number - 1  # global: the same key at any PP
        _attach(module, f"layers.{layer}.{kind}", settings, kind in COLUMN_TARGETS, tp, tp_rank)
        done.append(name)
        seen.add(kind)
    missing = [t for t in settings.targets if t not in seen]
    if missing and gpt.decoder.layers:  # a pipeline stage with layers holds every kind of a dense layer
        raise NotImplementedError(f"LoRA targets {missing} match no layer of this model (MoE expert layers are not "
                                  "supported yet)")
    saved = _mark_saved_modules(gpt, settings.modules_to_save)
    for param in gpt.parameters():
        if not is_adapter_param(param) and not is_value_head_param(param) and id(param) not in saved:
            param.requires_grad_(False)
    return done


def _mark_saved_modules(gpt: torch.nn.Module, names: tuple[str, ...]) -> set[int]:
    """Mark the parameters of `names` (--lora-modules-to-save) as trained beside the adapters; their ids.

    Why the LM head: a body change (any LoRA, or full fine-tuning of the layers) only moves the final hidden state,
    which the final norm brings to a fixed length before the head; with the head frozen the reachable logit margins
    are bounded by the head's rows. On the embedded default that bound is p(answer) ~0.3 (docs/lora.md)."""
    ids: set[int] = set()
    for name in names:
        if name != "output_layer":
            raise ValueError(f"LoRA modules_to_save: {name!r} is not supported (output_layer only)")
        if getattr(gpt, "share_embeddings_and_output_weights", False):
            raise NotImplementedError("--lora-modules-to-save output_layer on a model whose LM head is tied to its "
                                      "input embeddings is not supported yet")
        layer = getattr(gpt, "output_layer", None)
        if layer is None:  # a pipeline stage without the head: nothing of it here
            continue
        for param in layer.parameters():
            param.relax_lora_saved = True
            ids.add(id(param))
    return ids


@torch.no_grad()
def merged_weight(param: torch.Tensor) -> torch.Tensor:
    """`param` detached, or for the weight of an adapted linear W + alpha / r * B @ A (this rank's shard: B's rows
    match W's for a column-parallel linear, A's columns W's for a row-parallel one), in W's dtype."""
    ref = getattr(param, "relax_lora_module", None)
    module = ref() if ref is not None else None
    if module is None:
        return param.detach()
    delta = (module.lora_B.float() @ module.lora_A.float()) * module.lora_scale
    return (param.detach().float() + delta).to(param.dtype)


def _adapter_keys(gpt: torch.nn.Module) -> set[str]:
    from relax.backends.megatron.model import is_value_head_param

    return {n for n, p in gpt.named_parameters() if is_adapter_param(p) or is_value_head_param(p)
            or is_saved_module_param(p)}


def checkpoint_state(gpt: torch.nn.Module) -> dict[str, Any]:
    """What a checkpoint keeps of the model: with adapters only the trained tensors (adapters, a value head, the
    modules of --lora-modules-to-save), the frozen base coming from --hf-checkpoint / --ref-load again at resume;
    the full state dict otherwise."""
    state = gpt.state_dict()
    keys = _adapter_keys(gpt)
    if not any(is_adapter_param(p) for p in gpt.parameters()):
        return state
    return {k: v for k, v in state.items() if k in keys}


def load_checkpoint_state(gpt: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load a model state of `checkpoint_state` (or a full one). With adapters the base's tensors may be missing
    (it is frozen and loaded at start) but every adapter must be there unless none is (a checkpoint of the base
    alone: the adapters keep their initial values); anything unknown is an error."""
    if not has_adapters(gpt):
        gpt.load_state_dict(state, strict=True)
        return
    keys = _adapter_keys(gpt)
    result = gpt.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise KeyError(f"checkpoint tensors unknown to this model: {result.unexpected_keys[:8]}")
    missing = [k for k in result.missing_keys if k in keys]
    if missing and len(missing) < len(keys):
        raise KeyError(f"checkpoint lacks adapter tensors {missing[:8]} (another --lora-rank or "
                       "--lora-target-modules?)")


def adapter_tensors(gpt: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter of this rank, full (gathered over TP, in the TP 1 layout: a gated fc1's B as [gate; up]):
    (module name + ".lora_A"/".lora_B") -> CPU tensor. Collective over the tensor-parallel group."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()
    out = {}
    for name, module in gpt.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        for which in ("lora_A", "lora_B"):
            t = getattr(module, which).detach()
            if tp > 1 and getattr(getattr(module, which), "tensor_model_parallel", False):
                parts = [torch.empty_like(t) for _ in range(tp)]
                torch.distributed.all_gather(parts, t.contiguous(), group=group)
                dim = getattr(module, which).partition_dim
                if name.endswith("linear_fc1") and module.config.gated_linear_unit:  # each rank: [gate; up]
                    halves = [p.chunk(2, dim=0) for p in parts]
                    t = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
                else:
                    t = torch.cat(parts, dim=dim)
            out[f"{name}.{which}"] = t.cpu().clone()
    return out


def lora_settings(config: Any) -> Optional[LoraSettings]:
    """The run's LoRA settings (None with --lora-rank 0)."""
    from relax.config.rules_lora import lora_targets

    if not getattr(config, "lora_rank", 0):
        return None
    return LoraSettings(rank=int(config.lora_rank), alpha=float(config.lora_alpha), dropout=float(config.lora_dropout),
                        targets=lora_targets(config), init=config.lora_init, seed=int(config.seed),
                        modules_to_save=tuple(getattr(config, "lora_modules_to_save", None) or ()))


def load_adapters(trainer: Any, path: str) -> None:
    """--lora-load: the adapters of a PEFT folder (adapter_config.json, as --save-hf writes it with LoRA) or of a
    Relax checkpoint of a LoRA run (a --save folder, an iter_* folder or its actor folder; same rank, targets and
    parallel layout) into `trainer`'s model; the base, the optimizer and the
    iteration are left as they are. Every adapter must be in the checkpoint."""
    import torch.distributed as dist

    from relax.backends.megatron.checkpoint import load_state_file, read_meta
    from relax.formats.checkpoint_layout import rank_file, resolve_model_checkpoint
    from relax.backends.megatron.hf_weights import unwrap_model

    gpt = unwrap_model(trainer.model)
    if (Path(path) / "adapter_config.json").is_file():  # a PEFT adapter (relax.backends.megatron.lora_peft)
        from relax.backends.megatron.lora_peft import load_peft_state

        state = load_peft_state(gpt, trainer.arch, path)
    else:
        kind, where = resolve_model_checkpoint(path)
        if kind != "relax":
            raise ValueError(f"--lora-load {path}: a Hugging Face model folder, neither a PEFT adapter "
                             "(adapter_config.json) nor a Relax checkpoint of a LoRA run")
        state = load_state_file(where / rank_file(dist.get_rank()), read_meta(where).get("iteration"))["model"]
    keys = sorted(n for n, p in gpt.named_parameters() if is_adapter_param(p) or is_saved_module_param(p))
    missing = [k for k in keys if k not in state]
    if missing:
        raise KeyError(f"--lora-load {path}: no adapter tensors {missing[:4]} (a checkpoint of another "
                       "--lora-rank / --lora-target-modules, or of a run without LoRA?)")
    with torch.no_grad():
        named = dict(gpt.named_parameters())
        for k in keys:
            if state[k].shape != named[k].shape:
                raise ValueError(f"--lora-load {path}: {k} is {tuple(state[k].shape)}, this model's "
                                 f"{tuple(named[k].shape)} (another --lora-rank or parallel layout)")
            named[k].copy_(state[k])
    if trainer.optimizer is not None:
        trainer.optimizer.reload_model_params()
