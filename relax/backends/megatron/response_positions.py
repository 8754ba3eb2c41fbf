"""The model's output layer applied only at the positions that predict response tokens.

Megatron's GPTModel applies its output layer (the LM head, or a critic's value head) to every position of the
micro-batch, [S, B, H] -> [B, S, V]; RL needs the rows that predict response tokens only, [B, R] of them
(`MicroBatch.logit_index`). On short answers to long prompts (the embedded default: ~2 of ~22 positions)
most of the head's matmul, the [B, S, V] transpose copy, the gather of the response rows and, in backward,
the zero-filled [B, S, V] gradient it scatters into are spent on rows nobody reads: measured on the embedded
default's shape (benchmarks/trainer_pass_bench.py), a fifth of a training pass.

`response_rows_only(model, mb)` is a context in which the output layer's input is first cut to those rows, so
the model returns [B, R, V]; `at_response_positions(output, mb)` then returns the rows either way (an output
of S positions is gathered as before). S > R always holds (a sample has at least one prompt token), so the
width tells the two apart.

Not applied where the cut would be wrong or is not local:
* sequence parallel: the output layer gathers the sequence shards itself, after its input is given;
* context parallel: this rank holds 2 chunks of the sequence, not the positions of `logit_index`;
* multi-token prediction: its layers read the full hidden states before the output layer.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from relax.backends.megatron.batching import MicroBatch

__all__ = ["response_rows_only", "at_response_positions", "cut_applies", "response_rows"]


def cut_applies(gpt_model: torch.nn.Module, *, sequence_parallel: bool, cp: int) -> bool:
    """Whether the output layer of this pipeline stage may be given the response rows alone."""
    if sequence_parallel or cp > 1:
        return False
    if not getattr(gpt_model, "post_process", False) or getattr(gpt_model, "output_layer", None) is None:
        return False
    return not getattr(gpt_model, "mtp_process", False)


def _cut(index: torch.Tensor):
    """A forward pre-hook that replaces the output layer's [S, B, H] input by its [R, B, H] rows at `index`
    ([B, R] positions)."""
    positions = index.t().contiguous()  # [R, B]

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["input_"]
        rows = positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]).to(hidden.device)
        picked = hidden.gather(0, rows)
        if args:
            return (picked,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "input_": picked}

    return hook


@contextlib.contextmanager
def response_rows_only(gpt_model: torch.nn.Module, mb: MicroBatch, enabled: bool) -> Iterator[None]:
    """Within the block, `gpt_model`'s output layer runs on the rows of `mb.logit_index` alone (when
    `enabled`; see `cut_applies`)."""
    if not enabled:
        yield
        return
    handle = gpt_model.output_layer.register_forward_pre_hook(_cut(mb.logit_index), with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def at_response_positions(output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """[B, R, V] rows of the model's output at the positions that predict each response token (position 0 past
    a sample's response; callers mask those)."""
    if output.shape[1] == mb.logit_index.shape[1]:  # already cut by `response_rows_only`
        return output
    index = mb.logit_index.unsqueeze(-1).expand(-1, -1, output.shape[-1])
    return output.gather(1, index)


def response_rows(rows: torch.Tensor, mb: MicroBatch) -> list[torch.Tensor]:
    """One tensor per sample from [B, R] response-aligned rows, cut to the sample's response length (each its own
    storage: a row is sent between processes on its own)."""
    lengths = mb.response_lengths
    valid = torch.arange(rows.shape[1]).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return [part.clone() for part in rows[valid].split(lengths)]
