"""Hugging Face <-> Megatron weights for Llama / Qwen2 / Qwen3 (and Qwen3-MoE, Qwen2-MoE) / GLM4 / Nemotron.

Loading walks Megatron's parameters, builds each one's full tensor from HF
tensors (fusing Q/K/V per query group and gate/up into `linear_fc1`; GLM4's HF
checkpoint already holds gate and up as one `gate_up_proj`; Nemotron's non-gated MLP has
up_proj only, and its LayerNorms a bias), and
copies this rank's tensor-parallel shard. Exporting does the reverse: gathers
each parameter over its tensor-parallel group and splits it into HF tensors.

Both work per pipeline stage: a stage loads and exports only the layers (and
embedding / head) it holds. Local and Transformer Engine layer specs are both
understood (TE fuses the pre-attention / pre-MLP norms into the next linear).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from safetensors import safe_open

from relax.formats.hf_names import layer_hf_names
from relax.formats.model_arch import ModelArch
from relax.backends.megatron.lora import merged_weight

__all__ = [
    "load_hf_weights",
    "export_hf_weights",
    "load_hf_checkpoint_dir",
    "unwrap_model",
]

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
# HF tensors that carry no learned state.
_IGNORED_HF = re.compile(r"rotary_emb\.inv_freq$")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The `GPTModel` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


# --------------------------------------------------------------------------- #
# Fusing and splitting                                                         #
# --------------------------------------------------------------------------- #


def fuse_qkv(arch: ModelArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> Megatron's per-group layout.

    Per query group g: [q heads of g, k_g, v_g], groups concatenated.
    """
    ng, hn = arch.num_query_groups, arch.kv_channels
    per_group = arch.num_attention_heads // ng
    tail = q.shape[1:]
    fused = torch.cat(
        [q.reshape(ng, per_group * hn, *tail), k.reshape(ng, hn, *tail), v.reshape(ng, hn, *tail)],
        dim=1,
    )
    return fused.reshape(ng * (per_group + 2) * hn, *tail)


def split_qkv(arch: ModelArch, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inverse of `fuse_qkv`."""
    ng, hn = arch.num_query_groups, arch.kv_channels
    per_group = arch.num_attention_heads // ng
    tail = fused.shape[1:]
    grouped = fused.reshape(ng, (per_group + 2) * hn, *tail)
    q, k, v = torch.split(grouped, [per_group * hn, hn, hn], dim=1)
    return (
        q.reshape(ng * per_group * hn, *tail),
        k.reshape(ng * hn, *tail),
        v.reshape(ng * hn, *tail),
    )


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad], dim=0)


# --------------------------------------------------------------------------- #
# Name mapping                                                                 #
# --------------------------------------------------------------------------- #


def _expert_hf_names(layer: int, expert: int, suffix: str) -> Optional[tuple[str, list[str]]]:
    e = f"model.layers.{layer}.mlp.experts.{expert}."
    if suffix == "linear_fc1.weight":
        return "fc1", [e + "gate_proj.weight", e + "up_proj.weight"]
    if suffix == "linear_fc2.weight":
        return "copy", [e + "down_proj.weight"]
    return None


class _ParamInfo:
    """How one Megatron parameter relates to HF tensors and to its TP group."""

    __slots__ = ("name", "param", "kind", "hf_names", "is_expert", "is_vocab", "expert_key")

    def __init__(self, name, param, kind, hf_names, is_expert=False, is_vocab=False, expert_key=None):
        self.name = name
        self.param = param
        self.kind = kind
        self.hf_names = hf_names
        self.is_expert = is_expert
        self.is_vocab = is_vocab
        # (layer, local expert index, suffix) for expert parameters
        self.expert_key = expert_key


def _param_infos(model: torch.nn.Module, arch: ModelArch) -> list[_ParamInfo]:
    gpt = unwrap_model(model)
    infos: list[_ParamInfo] = []
    for name, param in gpt.named_parameters():
        if getattr(param, "relax_value_head", False) or getattr(param, "relax_lora", False):
            continue  # a critic's value head (relax.backends.megatron.model.ValueHead), LoRA adapters: no HF tensor
        if name == "embedding.word_embeddings.weight":
            infos.append(_ParamInfo(name, param, "copy", ["model.embed_tokens.weight"], is_vocab=True))
            continue
        if name == "output_layer.weight":
            hf = "lm_head.weight" if arch.untie_embeddings_and_output_weights else "model.embed_tokens.weight"
            infos.append(_ParamInfo(name, param, "copy", [hf], is_vocab=True))
            continue
        if name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
            infos.append(_ParamInfo(name, param, "copy", ["model.norm." + name.rsplit(".", 1)[1]]))
            continue
        match = _LAYER_RE.match(name)
        if match is None:
            raise KeyError(f"no HF counterpart for Megatron parameter {name!r}")
        local, suffix = int(match.group(1)), match.group(2)
        layer = gpt.decoder.layers[local].layer_number - 1
        expert = _EXPERT_RE.match(suffix)
        expert_key = None
        if expert is not None:
            local_expert = int(expert.group(1))
            global_expert = _local_expert_range(arch)[0] + local_expert
            mapped = _expert_hf_names(layer, global_expert, expert.group(2))
            expert_key = (layer, local_expert, expert.group(2))
        else:
            mapped = layer_hf_names(layer, suffix, arch)
        if mapped is None:
            raise KeyError(f"no HF counterpart for Megatron parameter {name!r}")
        infos.append(
            _ParamInfo(
                name, param, mapped[0], mapped[1],
                is_expert=expert_key is not None, expert_key=expert_key,
            )
        )
    return infos


def _local_expert_range(arch: ModelArch) -> tuple[int, int]:
    """[first, last) global expert indices held by this expert-parallel rank."""
    from megatron.core import parallel_state as ps

    num_local = arch.num_experts // ps.get_expert_model_parallel_world_size()
    first = ps.get_expert_model_parallel_rank() * num_local
    return first, first + num_local


# --------------------------------------------------------------------------- #
# Tensor-parallel sharding                                                     #
# --------------------------------------------------------------------------- #


def _tp_group(info: _ParamInfo):
    from megatron.core import parallel_state as ps

    if info.is_expert:
        return (
            ps.get_expert_tensor_parallel_group(check_initialized=False),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
        )
    return (
        ps.get_tensor_model_parallel_group(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
    )


def _is_split(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def _shard(full: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    if size == 1:
        return full
    if full.shape[dim] % size:
        raise ValueError(f"dimension {dim} of shape {tuple(full.shape)} not divisible by {size}")
    return full.chunk(size, dim=dim)[rank]


def _gather(shard: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank's shard, in rank order (the caller concatenates them along the split dimension)."""
    if size == 1:
        return [shard]
    shard = shard.contiguous()
    parts = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(parts, shard, group=group)
    return parts


# --------------------------------------------------------------------------- #
# Public API                                                                   #
# --------------------------------------------------------------------------- #


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module,
    arch: ModelArch,
    hf_state_dict: Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
) -> None:
    """Copy HF-named tensors into this rank's Megatron parameters (its TP shard).

    With `strict`, every parameter of this stage must be found, and every HF
    tensor of the layers this stage holds must be used.
    """
    infos = _param_infos(model, arch)
    used: set[str] = set()
    for info in infos:
        missing = [n for n in info.hf_names if n not in hf_state_dict]
        if missing:
            if strict:
                raise KeyError(f"HF tensors {missing} needed for {info.name!r} are missing")
            continue
        tensors = [hf_state_dict[n] for n in info.hf_names]
        used.update(info.hf_names)
        param = info.param
        _, size, rank = _tp_group(info)
        split = _is_split(param)
        dim = getattr(param, "partition_dim", 0)
        if info.kind in ("fc1", "gate_up"):
            gate, up = tensors if info.kind == "fc1" else tensors[0].chunk(2, dim=0)
            if split:
                gate, up = _shard(gate, dim, size, rank), _shard(up, dim, size, rank)
            local = torch.cat([gate, up], dim=0)
        else:
            full = fuse_qkv(arch, *tensors) if info.kind == "qkv" else tensors[0]
            if info.is_vocab:
                full = _pad_rows(full, arch.vocab_size)
            local = _shard(full, dim, size, rank) if split else full
        if local.shape != param.shape:
            raise ValueError(
                f"{info.name}: HF gives shard {tuple(local.shape)}, parameter is {tuple(param.shape)}"
            )
        param.copy_(local.to(device=param.device, dtype=param.dtype))
    if strict:
        _check_unused(model, arch, hf_state_dict, used)


def _check_unused(
    model, arch: ModelArch, hf_state_dict: Mapping[str, torch.Tensor], used: set[str]
) -> None:
    """Raise if HF tensors belonging to this stage's layers were not used."""
    gpt = unwrap_model(model)
    layers = {layer.layer_number - 1 for layer in gpt.decoder.layers}
    experts = range(*_local_expert_range(arch)) if arch.is_moe else range(0)
    unused = []
    for name in hf_state_dict.keys():
        if name in used or _IGNORED_HF.search(name):
            continue
        expert = re.match(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.", name)
        if expert is not None and int(expert.group(1)) not in experts:
            continue  # another expert-parallel rank's expert
        match = re.match(r"^model\.layers\.(\d+)\.", name)
        if match is not None and int(match.group(1)) in layers:
            unused.append(name)
    if unused:
        raise KeyError(f"HF tensors not mapped onto Megatron: {unused[:8]}")


@torch.no_grad()
def export_hf_weights(
    model: torch.nn.Module,
    arch: ModelArch,
    *,
    dtype: Optional[torch.dtype] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the parameters this pipeline stage holds.

    Collective over each tensor-parallel group: every TP rank must iterate the
    generator to the end (all of them get the same tensors). Tied output
    weights are not yielded twice. Tensors are new (safe to keep).
    """
    emitted: set[str] = set()
    for info in _param_infos(model, arch):
        if info.hf_names[0] in emitted:
            continue  # the tied output layer
        named = list(zip(info.hf_names, _gather_full(info, arch)))
        if info.is_expert:
            named = _gather_experts(info, arch, named)
        for hf_name, tensor in named:
            emitted.add(hf_name)
            tensor = tensor.contiguous()
            yield hf_name, tensor.to(dtype) if dtype is not None else tensor


def _gather_full(info: _ParamInfo, arch: ModelArch) -> list[torch.Tensor]:
    """The HF tensors of one Megatron parameter, gathered over its TP group."""
    param = merged_weight(info.param)  # with LoRA W + alpha / r * B @ A, else the parameter itself
    group, size, _ = _tp_group(info)
    dim = getattr(info.param, "partition_dim", 0)
    parts = _gather(param, group, size) if _is_split(info.param) else [param]
    if info.kind in ("fc1", "gate_up"):  # each rank holds [its gate rows; its up rows]
        halves = [p.chunk(2, dim=0) for p in parts]
        gate, up = torch.cat([h[0] for h in halves], dim=dim), torch.cat([h[1] for h in halves], dim=dim)
        return [gate, up] if info.kind == "fc1" else [torch.cat([gate, up], dim=0)]
    full = torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].clone()
    if info.is_vocab:
        full = full[: arch.hf_vocab_size].clone()
    return list(split_qkv(arch, full)) if info.kind == "qkv" else [full]


def _gather_experts(
    info: _ParamInfo, arch: ModelArch, named: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """The same local expert's tensors from every expert-parallel rank, HF-named."""
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return named
    group = ps.get_expert_model_parallel_group()
    layer, local, suffix = info.expert_key
    num_local = arch.num_experts // ep
    out: list[tuple[str, torch.Tensor]] = []
    for index, (_, tensor) in enumerate(named):
        parts = _gather(tensor, group, ep)
        for rank, part in enumerate(parts):
            names = _expert_hf_names(layer, rank * num_local + local, suffix)[1]
            out.append((names[index], part))
    return out


class _SafetensorsDir(Mapping):
    """A read-only, lazily loaded mapping over a folder's safetensors files."""

    def __init__(self, files: list[Path], device: str = "cpu"):
        self._handles = [safe_open(str(f), framework="pt", device=device) for f in files]
        self._where: dict[str, int] = {}
        for i, handle in enumerate(self._handles):
            for key in handle.keys():
                self._where[key] = i

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._handles[self._where[key]].get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key) -> bool:
        return key in self._where


def load_hf_checkpoint_dir(path: str | Path) -> Mapping[str, torch.Tensor]:
    """The tensors of an HF model folder, keyed by HF name, read lazily.

    Reads `*.safetensors` (sharded or not; the index file is honoured); falls
    back to `pytorch_model*.bin` loaded eagerly with `weights_only=True`.
    """
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return _SafetensorsDir([path / n for n in names])
    files = sorted(path.glob("*.safetensors"))
    if files:
        return _SafetensorsDir(files)
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no safetensors or pytorch_model*.bin under {path}")
    state: dict[str, torch.Tensor] = {}
    for b in bins:
        state.update(torch.load(b, map_location="cpu", weights_only=True))
    return state

