"""The default data source (`--data-source-path`): prompt groups from the prompt file, plus a buffer.

`get_samples(num_groups)` returns `num_groups` prompt groups (`list[Sample]` of
`--n-samples-per-prompt` samples sharing `group_index`): first groups chosen from the buffer by
`--buffer-filter-path` (default `pop_first`), then fresh prompts (encoded, long prompts dropped and
counted). `add_samples(groups)` (alias `add_back`) puts groups back, e.g. the surplus of over-sampling
or aborted partial rollouts. `state_dict()` is JSON: prompt position, buffer and group counter.

A custom data source class is built as `cls(args, prompt_encoder=...)` (or `cls(args)`) and needs
`get_samples(n)` and `add_samples(groups)`; `state_dict`/`load_state_dict`/`stats` are optional.

A buffer filter is `fn(args, buffer, num_groups) -> list[list[Sample]]` (`fn(args, buffer)` and
`fn(buffer)` are accepted too): the groups to serve now, taken from `buffer`; the rest stay buffered.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Sequence

from relax.data.sample import Sample
from relax.rollout.context import call_flexible, load_hook
from relax.rollout.data_source import PromptDataSource
from relax.rollout.multimodal import SAMPLE_KEY as MULTIMODAL
from relax.rollout.prompts import PromptEncoder

logger = logging.getLogger(__name__)


def pop_first(args: Any, buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    """The default buffer filter: oldest groups first."""
    return buffer[:num_groups]


class RolloutDataSourceWithBuffer:
    def __init__(self, args: Any, *, prompt_encoder: Any = None, tokenizer: Any = None):
        self.args = args
        if prompt_encoder is None:
            if tokenizer is None:
                from transformers import AutoTokenizer  # not at the top: the driver imports this module
                tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
            prompt_encoder = PromptEncoder.from_args(args, tokenizer)
        self.encoder = prompt_encoder
        self.n_samples = int(args.n_samples_per_prompt)
        self.prompts = PromptDataSource.from_args(args, prompt_encoder=prompt_encoder) if args.prompt_data else None
        self.buffer: list[list[Sample]] = []
        self.buffer_filter = load_hook(args.buffer_filter_path, "--buffer-filter-path") or pop_first
        self.next_group = 0
        self.counts = {"served_from_buffer": 0, "served_fresh": 0}

    # ------------------------------------------------------------------ serving
    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        out = self._take_from_buffer(num_groups) if self.buffer else []
        self.counts["served_from_buffer"] += len(out)
        while len(out) < num_groups:
            if self.prompts is None:
                raise RuntimeError("no prompt data: set --prompt-data")
            record = self.prompts.get_batch(1)[0]
            if isinstance(record, list):  # a group handed back to the prompt source directly
                out.append(record)
                continue
            tokens = self.encoder.encode_or_none(record)
            if tokens is None:
                continue  # counted by the encoder as a filtered long prompt
            group = self.next_group
            self.next_group += 1
            extra = {MULTIMODAL: record.multimodal} if getattr(record, "multimodal", None) else {}
            out.append([Sample(group_index=group, prompt=record.prompt, prompt_tokens=list(tokens),
                               label=record.label, metadata={**record.metadata, "prompt_index": record.index, **extra},
                               ) for _ in range(self.n_samples)])
            self.counts["served_fresh"] += 1
        return out

    def _take_from_buffer(self, num_groups: int) -> list[list[Sample]]:
        chosen = call_flexible(self.buffer_filter, self.args, list(self.buffer), num_groups)
        chosen = list(chosen or [])[:num_groups]
        ids = {id(g) for g in chosen}
        if len(ids) != len(chosen) or not all(any(g is b for b in self.buffer) for g in chosen):
            raise ValueError("--buffer-filter-path must return groups taken from the buffer it was given "
                             "(each at most once)")
        self.buffer = [g for g in self.buffer if id(g) not in ids]
        return chosen

    def add_samples(self, groups: Sequence[list[Sample]]) -> None:
        for g in groups:
            if not isinstance(g, list) or not g:
                raise TypeError("add_samples takes a list of non-empty prompt groups (lists of Samples)")
            self.buffer.append(g)

    add_back = add_samples

    def stats(self) -> dict:
        out = {"buffered_groups": len(self.buffer), **self.counts}
        out["filtered_long_prompts"] = self.encoder.stats()["filtered_long_prompts"] if self.encoder else 0
        if self.prompts is not None:
            out["epoch"] = self.prompts.epoch
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"prompts": self.prompts.state_dict() if self.prompts is not None else None,
                "buffer": [[s.to_dict() for s in g] for g in self.buffer],
                "next_group": self.next_group, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        if "buffer" not in state:  # a plain PromptDataSource state (older checkpoints)
            self.prompts.load_state_dict(state)
            return
        if state.get("prompts") is not None and self.prompts is not None:
            self.prompts.load_state_dict(state["prompts"])
        self.buffer = [[Sample.from_dict(d) for d in g] for g in state["buffer"]]
        self.next_group = int(state["next_group"])
        self.counts.update(state.get("counts", {}))


def build_data_source(args: Any, prompt_encoder: Any = None) -> Any:
    """The `--data-source-path` class, built with the shared prompt encoder when it takes one."""
    cls = load_hook(args.data_source_path, "--data-source-path")
    try:
        takes_encoder = "prompt_encoder" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        takes_encoder = False
    source = cls(args, prompt_encoder=prompt_encoder) if takes_encoder else cls(args)
    for method in ("get_samples", "add_samples"):
        if not callable(getattr(source, method, None)):
            raise TypeError(f"--data-source-path {args.data_source_path}: the data source has no {method}()")
    return source


def reset_group(group: list[Sample]) -> list[Sample]:
    """A group back to prompt-only state (to be generated again)."""
    for s in group:
        s.response_tokens, s.response_logprobs, s.loss_mask, s.response_text = [], [], [], ""
        s.reward, s.raw_reward, s.status = 0.0, None, "completed"
        for key in ("rid", "resumed_tokens", "aborted_count", "reward_error"):
            s.metadata.pop(key, None)
    return group


def is_generated(sample: Sample) -> bool:
    """Whether a sample already holds a finished response (from the buffer) and needs no generation."""
    return bool(sample.response_tokens) and sample.status != "aborted"


