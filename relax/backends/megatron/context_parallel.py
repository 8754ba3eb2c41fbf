"""Context parallelism (--context-parallel-size) for the local (pure PyTorch) layer spec.

Shape conventions: Megatron's activations are [s, b, ...] inside the transformer and the model's input and
output are [b, s, ...]. With CP size `cp` each rank holds 2 of the sequence's `2 cp` equal chunks, `r` and
`2 cp - 1 - r` (Megatron's load-balanced split, which its rotary embedding assumes: `get_pos_emb_on_this_cp_rank`),
so every rank gets the same share of causal-attention work. Sequences are padded to a multiple of `2 cp`.

On GPU, Transformer Engine's attention does this natively (--allgather-cp picks its all-gather exchange, the
default its ring); Megatron's local attention refuses CP, so on CPU `ContextParallelAttention` replaces it: it
all-gathers keys and values of the whole sequence (the all-gather exchange) and attends from this rank's queries
with the causal mask of their global positions.

The trainer's loss needs whole responses, which span chunks of several ranks: `gather_output` all-gathers the
model's output (logits or values) so that every CP rank computes the same, complete loss; its backward keeps
this rank's slice of the gradient (each rank differentiates the same loss, so the slices add up to the whole
gradient once DDP sums over the CP ranks — Megatron scales a two-output loss by the CP size and DDP divides by
data-parallel x CP, which cancel)."""

from __future__ import annotations

import copy
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule


def local_positions(seq_len: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """Global positions of this rank's tokens: chunks `rank` and `2 cp - 1 - rank` of `seq_len / (2 cp)`."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x context-parallel size {cp}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def split_sequence(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's load-balanced part of `x` along `dim`."""
    positions = local_positions(x.shape[dim], group.size(), group.rank(), x.device)
    return x.index_select(dim, positions)


def _gather_sequence(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's part of the sequence along `dim`, put back in global order."""
    cp = group.size()
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    full_len = x.shape[dim] * cp
    shape = list(x.shape)
    shape[dim] = full_len
    full = x.new_empty(shape)
    for rank, part in enumerate(parts):
        full.index_copy_(dim, local_positions(full_len, cp, rank, x.device), part)
    return full


class _GatherOutput(torch.autograd.Function):
    """All-gather forward; backward keeps this rank's slice (every rank computes the same downstream loss)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather_sequence(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return split_sequence(grad, ctx.dim, ctx.group), None, None


class _GatherKeysValues(torch.autograd.Function):
    """All-gather forward; backward sums the ranks' gradients and keeps this rank's slice (each rank's queries
    attend to every rank's keys and values)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather_sequence(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        return split_sequence(grad, ctx.dim, ctx.group), None, None


def gather_output(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The model's output [b, s_local, ...] -> [b, s, ...] in global order (see the module's docstring)."""
    group = ps.get_context_parallel_group()
    return _GatherOutput.apply(x, dim, group)


def split_input(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    return split_sequence(x, dim, ps.get_context_parallel_group())


class ContextParallelAttention(MegatronModule):
    """Core attention under context parallelism, in place of Megatron's local `DotProductAttention` (same
    constructor and call): queries [sq, b, np, hn] of this rank's chunks, keys and values [sq, b, ng, hn]
    all-gathered over the CP group, causal mask from global positions; returns [sq, b, np * hn]."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Any = None):
        super().__init__(config=config)
        tp = ps.get_tensor_model_parallel_world_size()
        groups = config.num_query_groups or config.num_attention_heads
        self.heads = config.num_attention_heads // tp
        self.groups = groups // tp
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_in_fp32 = bool(config.attention_softmax_in_fp32 or config.apply_query_key_layer_scaling)
        self.group = ps.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("context parallelism on the local layer spec takes padded micro-batches "
                                      "without attention bias")
        cp, rank = self.group.size(), self.group.rank()
        local_len = query.shape[0]
        keys = _GatherKeysValues.apply(key, 0, self.group)
        values = _GatherKeysValues.apply(value, 0, self.group)
        if self.groups != self.heads:  # grouped-query attention: each key/value head serves heads/groups queries
            keys = keys.repeat_interleave(self.heads // self.groups, dim=2)
            values = values.repeat_interleave(self.heads // self.groups, dim=2)
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = keys.permute(1, 2, 3, 0)  # [b, np, hn, s]
        v = values.permute(1, 2, 0, 3)  # [b, np, s, hn]
        compute = torch.float32 if self.softmax_in_fp32 else q.dtype
        scores = torch.matmul(q.to(compute), k.to(compute)) * self.scale
        q_pos = local_positions(local_len * cp, cp, rank, query.device)
        k_pos = torch.arange(local_len * cp, device=query.device)
        scores = scores.masked_fill(k_pos.unsqueeze(0) > q_pos.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if self.training and self.dropout_p > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = torch.nn.functional.dropout(probs, p=self.dropout_p)
        context = torch.matmul(probs, v)  # [b, np, sq, hn]
        return context.permute(2, 0, 1, 3).reshape(local_len, query.shape[1], self.heads * query.shape[-1])


def with_cp_attention(spec: Any) -> Any:
    """A copy of a local transformer-layer spec whose self-attention uses `ContextParallelAttention`."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return spec
