"""Turn RL samples into padded micro-batches (pure PyTorch, no Megatron).

A sample is a dict with
  - `tokens`: 1-D LongTensor, prompt followed by response,
  - `response_length`: int, the number of response tokens at the end of `tokens`,
  - per-response-token tensors (1-D, length `response_length`), e.g.
    `advantages`, `old_logprobs`, `loss_mask`,
  - optionally per-sample scalars (Python numbers or 0-d tensors).

Response token j of a sample (0-based) sits at `tokens[P + j]` (P = prompt
length) and is predicted by the logits at position `P + j - 1`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from relax.algorithms import pad_rows

__all__ = ["MicroBatch", "add_late_fields", "make_micro_batches", "token_budget_groups", "RESERVED_KEYS"]

RESERVED_KEYS = frozenset({"tokens", "response_length"})


@dataclass
class MicroBatch:
    """Right-padded inputs and response-aligned per-token fields.

    tokens, position_ids: [B, S]; logit_index, targets, mask: [B, R] where R is
    the longest response; fields: name -> [B, R] (per-token) or [B] (scalar).
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    logit_index: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    response_lengths: list[int]
    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_length(self) -> int:
        return self.tokens.shape[1]

    def to(self, device: torch.device) -> "MicroBatch":
        return MicroBatch(
            tokens=self.tokens.to(device),
            position_ids=self.position_ids.to(device),
            logit_index=self.logit_index.to(device),
            targets=self.targets.to(device),
            mask=self.mask.to(device),
            response_lengths=self.response_lengths,
            fields={k: v.to(device) for k, v in self.fields.items()},
        )


def _check_sample(i: int, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    tokens = sample["tokens"]
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        raise ValueError(f"sample {i}: tokens must be a 1-D tensor")
    resp = int(sample["response_length"])
    if not 1 <= resp < tokens.shape[0]:
        raise ValueError(
            f"sample {i}: response_length {resp} needs 1 <= it < len(tokens)={tokens.shape[0]}"
        )
    return (tokens if tokens.dtype == torch.long else tokens.long()), resp


def _collate(samples: Sequence[dict[str, Any]], pad_id: int, seq_multiple: int) -> MicroBatch:
    # Whole-batch tensor ops (padding, index arithmetic) rather than one small op per sample and field:
    # collation of the 512 samples of a step took a quarter of the training time of a tiny model.
    checked = [_check_sample(i, s) for i, s in enumerate(samples)]
    lengths = torch.tensor([t.shape[0] for t, _ in checked], dtype=torch.long)
    resps = torch.tensor([r for _, r in checked], dtype=torch.long)
    seq = math.ceil(int(lengths.max()) / seq_multiple) * seq_multiple
    resp_max = int(resps.max())
    tokens = pad_rows([t for t, _ in checked], seq, pad_id, torch.long)
    j = torch.arange(resp_max, dtype=torch.long)
    valid = j.unsqueeze(0) < resps.unsqueeze(1)
    mask = valid.to(torch.float32)
    # response token j of sample b is predicted at position P + j - 1 (P = prompt length); 0 past the response
    logit_index = torch.where(valid, (lengths - resps - 1).unsqueeze(1) + j.unsqueeze(0), 0)
    targets = tokens.gather(1, logit_index + 1)
    fields: dict[str, torch.Tensor] = {}
    keys = [k for k in samples[0] if k not in RESERVED_KEYS]
    for key in keys:
        values = [s[key] for s in samples]
        first = values[0]
        if isinstance(first, torch.Tensor) and first.dim() == 1:
            dtype = first.dtype if first.is_floating_point() else torch.float32
            sizes = torch.tensor([v.shape[0] for v in values], dtype=torch.long)
            if not torch.equal(sizes, resps):
                bad = int(torch.nonzero(sizes != resps)[0])
                raise ValueError(f"sample field {key!r} has {int(sizes[bad])} entries, response has "
                                 f"{int(resps[bad])}")
            # rows are as long as their responses, so the padded width is the longest response
            fields[key] = pad_rows(values, resp_max, 0.0, dtype)
        elif isinstance(first, (int, float, bool)) or (isinstance(first, torch.Tensor) and first.dim() == 0):
            fields[key] = torch.tensor([float(v) for v in values], dtype=torch.float32)
        # other values (strings, nested objects) are not model inputs: skipped
    if "loss_mask" in fields:
        mask = mask * (fields["loss_mask"] > 0).to(mask.dtype)
    positions = torch.arange(seq, dtype=torch.long).unsqueeze(0).expand(len(samples), -1).contiguous()
    return MicroBatch(
        tokens=tokens,
        position_ids=positions,
        logit_index=logit_index,
        targets=targets,
        mask=mask,
        response_lengths=resps.tolist(),
        fields=fields,
    )


def token_budget_groups(lengths: Sequence[int], max_tokens: int, seq_multiple: int = 1) -> list[list[int]]:
    """Split sample positions, in order, into consecutive groups whose padded size fits `max_tokens`.

    The padded size of a group is `count * longest` (longest rounded up to `seq_multiple`), which is
    what a right-padded micro-batch costs. A sample longer than the budget gets a group of its own.
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        padded = math.ceil(int(n) / seq_multiple) * seq_multiple
        grown = max(longest, padded)
        if current and grown * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, grown = [], padded
        current.append(i)
        longest = grown
    if current:
        groups.append(current)
    return groups


def make_micro_batches(
    samples: Sequence[dict[str, Any]],
    micro_batch_size: int,
    *,
    pad_id: int = 0,
    seq_multiple: int = 1,
    max_tokens: int | None = None,
) -> list[MicroBatch]:
    """Split `samples` in order into micro-batches of at most `micro_batch_size`.

    With `max_tokens` (dynamic batch size) micro-batches are instead consecutive runs of samples
    whose padded size (count x longest) stays within `max_tokens`; `micro_batch_size` is ignored.

    Each micro-batch is right-padded to its longest sample, rounded up to a
    multiple of `seq_multiple`. `mask` is 1 on real response tokens (and, when
    the samples carry `loss_mask`, only where it is > 0).
    """
    if max_tokens is not None:
        lengths = [int(s["tokens"].numel()) for s in samples]
        return [
            _collate([samples[i] for i in group], pad_id, seq_multiple)
            for group in token_budget_groups(lengths, max_tokens, seq_multiple)
        ]
    if micro_batch_size < 1:
        raise ValueError("micro_batch_size must be >= 1")
    return [
        _collate(samples[i : i + micro_batch_size], pad_id, seq_multiple)
        for i in range(0, len(samples), micro_batch_size)
    ]


def add_late_fields(mb: MicroBatch, late: dict[str, Any], start: int) -> None:
    """Per-token fields of the micro-batch's samples given after collation, padded as `_collate` pads them:
    `late[name](lo, hi)` -> the rows of samples [lo, hi) of the step, this micro-batch's being [start, start +
    size). A field the micro-batch has is kept (a loss recomputed under activation checkpointing asks again)."""
    for name, rows_of in late.items():
        if name in mb.fields:
            continue
        rows = rows_of(start, start + mb.size)
        sizes = [int(r.shape[0]) for r in rows]
        if sizes != list(mb.response_lengths):
            bad = next(i for i, (a, b) in enumerate(zip(sizes, mb.response_lengths)) if a != b)
            raise ValueError(f"sample field {name!r} has {sizes[bad]} entries, response has "
                             f"{mb.response_lengths[bad]}")
        mb.fields[name] = pad_rows(rows, mb.targets.shape[1], 0.0, torch.float32).to(mb.tokens.device)
