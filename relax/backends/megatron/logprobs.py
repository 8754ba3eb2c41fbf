"""Per-token log-probabilities (and entropy) from vocab-parallel logits.

Logits may be split over the tensor-parallel group along the vocabulary (the
output of Megatron's `GPTModel` with `parallel_output=True`). Everything here
is differentiable and matches a full `log_softmax` over the unsplit logits.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

__all__ = ["token_logprobs", "vocab_parallel_entropy"]

# Padded vocabulary entries get this logit: exp() underflows to exactly 0 and
# 0 * logit stays finite (unlike -inf), so entropy is unaffected.
_MASKED_LOGIT = -1.0e30


def _tp_info() -> tuple[object, int, int]:
    """Megatron's tensor-parallel group, its size and this rank's index in it."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    return group, dist.get_world_size(group), dist.get_rank(group)


def _mask_padded_vocab(logits: torch.Tensor, vocab_start: int, real_vocab: Optional[int]) -> torch.Tensor:
    if real_vocab is None:
        return logits
    local = logits.shape[-1]
    if vocab_start + local <= real_vocab:
        return logits
    ids = torch.arange(vocab_start, vocab_start + local, device=logits.device)
    return logits.masked_fill(ids >= real_vocab, _MASKED_LOGIT)


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the full (TP-split) vocabulary, differentiable.

    `logits`: [..., V / tp], float32 preferred. Returns [...].
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group, size, _ = _tp_info()
    with torch.no_grad():
        shift = logits.max(dim=-1).values
        if size > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - shift.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    sum_exp_z = (exp * shifted).sum(dim=-1)
    if size > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp, group=group)
        sum_exp_z = reduce_from_tensor_model_parallel_region(sum_exp_z, group=group)
    return sum_exp.log() - sum_exp_z / sum_exp


class _LocalCrossEntropy(torch.autograd.Function):
    """Megatron's `vocab_parallel_cross_entropy` for an unsplit vocabulary (tensor-parallel size 1): the same
    arithmetic, through Megatron's own `VocabParallelCrossEntropy` steps, without its three all-reduces over a
    one-rank group (each a gloo round trip: ~12 of them per step of the embedded default, a few ms each on a
    loaded CPU). Works in place on its input, as Megatron's does."""

    @staticmethod
    def forward(ctx, logits, target):
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as steps

        logits, logits_max = steps.calculate_logits_max(logits)
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = steps.calculate_predicted_logits(
            logits, target, logits_max, 0, logits.size(-1))
        softmax, loss = steps.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as steps

        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, update, grad_input = steps.prepare_gradient_calculation_operands(softmax, target_mask)
        return steps.calculate_gradients(grad_2d, arange_1d, masked_target_1d, update, grad_input, grad_output), None


def _chunk_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    real_vocab: Optional[int],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    _, size, rank = _tp_info()
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    scaled = _mask_padded_vocab(scaled, rank * logits.shape[-1], real_vocab)
    entropy = vocab_parallel_entropy(scaled) if with_entropy else None
    # vocab_parallel_cross_entropy works in place on its input: give it its own copy.
    private = scaled.clone() if with_entropy or scaled is logits else scaled
    nll = _LocalCrossEntropy.apply(private, targets) if size == 1 else vocab_parallel_cross_entropy(private, targets)
    return -nll, entropy


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: Optional[int] = None,
    real_vocab_size: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of `targets` under softmax(logits / temperature), and optionally entropy.

    Args:
        logits: [B, T, V_local], this rank's vocabulary shard (V_local = V / tp).
        targets: [B, T] token ids in the full vocabulary.
        temperature: logits are divided by it before the softmax.
        with_entropy: also return the entropy [B, T] of the tempered distribution.
        chunk_size: process the sequence in chunks of this many positions; with
            autograd on, each chunk is recomputed in backward, so the float32
            softmax is never held for the whole sequence.
        real_vocab_size: logits of vocabulary ids >= this (padding) are ignored.

    The vocabulary is split over Megatron's tensor-parallel group (call this on
    every rank of it).

    Returns:
        (logprobs [B, T] float32, entropy [B, T] float32 or None)
    """
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    seq = logits.shape[1]
    if chunk_size is None or chunk_size >= seq:
        return _chunk_logprobs(logits, targets, temperature, with_entropy, real_vocab_size)
    logprob_parts, entropy_parts = [], []
    recompute = torch.is_grad_enabled() and logits.requires_grad
    for start in range(0, seq, chunk_size):
        args = (
            logits[:, start : start + chunk_size],
            targets[:, start : start + chunk_size],
            temperature,
            with_entropy,
            real_vocab_size,
        )
        if recompute:
            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        logprob_parts.append(lp)
        entropy_parts.append(ent)
    logprobs = torch.cat(logprob_parts, dim=1)
    entropy = torch.cat(entropy_parts, dim=1) if with_entropy else None
    return logprobs, entropy
