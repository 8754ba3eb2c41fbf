"""Small shared helpers for the algorithm functions (private)."""

from __future__ import annotations

from typing import Sequence

import torch


def float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The floating dtype to compute in: the widest floating dtype among ``tensors``.

    Half/bfloat16 inputs are promoted to float32 (all reductions are done in at least
    float32); integer/bool inputs count as float32.
    """
    dtype = torch.float32
    for t in tensors:
        if t.dtype == torch.float64:
            dtype = torch.float64
    return dtype


def as_mask(mask: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(bool_mask, float_mask)`` with ``float_mask`` in ``like``'s dtype."""
    bool_mask = mask.bool() if mask.dtype != torch.bool else mask
    return bool_mask, bool_mask.to(like.dtype)


def zero_outside(x: torch.Tensor, bool_mask: torch.Tensor) -> torch.Tensor:
    """``x`` with positions outside ``bool_mask`` replaced by exact zeros.

    Uses ``torch.where`` (not multiplication) so NaN/inf garbage in padding never leaks
    into values or gradients.
    """
    return torch.where(bool_mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def per_token(adv: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a ``[B]`` per-sample tensor to ``like``'s ``[B, T]`` shape (``[B, T]`` passes)."""
    if adv.dim() == like.dim() - 1:
        adv = adv.unsqueeze(-1)
    return adv.expand_as(like)



def pad_rows(rows: Sequence[Sequence[float] | torch.Tensor], width: int, pad: float = 0.0,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """1-D rows (tensors or lists) right-padded with `pad` to ``[len(rows), width]`` in `dtype`.

    One concatenation and one indexed write rather than a copy per row: a step pads its 512 rows several times
    (advantages, micro-batches), and a copy per short row costs more than the rows' data."""
    out = torch.full((len(rows), width), pad, dtype=dtype)
    if not rows:
        return out
    # 1-D tensors (the common case) go as they are: a reshape per row costs more than its copy
    parts = [row if isinstance(row, torch.Tensor) and row.dim() == 1 else
             (row if isinstance(row, torch.Tensor) else torch.as_tensor(row, dtype=dtype)).reshape(-1) for row in rows]
    lengths = torch.tensor([part.shape[0] for part in parts])
    flat = torch.cat(parts).to(dtype)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(flat.numel()) - torch.repeat_interleave(starts, lengths)
    out[torch.repeat_interleave(torch.arange(len(parts)), lengths), cols] = flat
    return out
