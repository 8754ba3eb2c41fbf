"""The ``Sample`` record that flows from rollout to training.

One ``Sample`` is one (prompt, response) pair produced by the rollout engine. Samples that
share a prompt (GRPO-style groups) share ``group_index``. ``index`` is a global sample id,
unique within a training step; the data plane returns samples sorted by it.

Column dicts (``samples_to_columns`` / ``columns_to_samples``) are the batched form:
``{field_name: [value_of_sample_0, value_of_sample_1, ...]}``.

Two kinds of fields (``ROLLOUT_FIELDS``, ``STAGE_FIELDS``): the rollout writes a sample once with its rollout
fields; each later stage of a training step (relax.core.stages) adds its own per-response-token field to the
samples already stored (``DataPlane.put_fields``): ``old_logprobs`` (actor forward), ``ref_logprobs``
(reference), ``teacher_logprobs`` (on-policy-distillation teacher), ``values`` (critic), ``advantages`` and
``returns`` (advantage estimation). A stage field is None until its stage wrote it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

# Allowed values of ``Sample.status``.
STATUS_COMPLETED = "completed"
STATUS_TRUNCATED = "truncated"
STATUS_ABORTED = "aborted"
STATUS_FAILED = "failed"
SAMPLE_STATUSES = (STATUS_COMPLETED, STATUS_TRUNCATED, STATUS_ABORTED, STATUS_FAILED)


@dataclass
class Sample:
    """One rollout sample.

    Attributes:
        index: global sample id (unique within a step).
        group_index: prompt-group id; samples generated from the same prompt share it.
        prompt: the prompt, a string or a list of chat messages (any picklable object).
        prompt_tokens: prompt token ids.
        response_tokens: response token ids (everything after the prompt, including tool /
            environment tokens in multi-turn rollouts; see ``loss_mask``).
        response_logprobs: per-response-token log-probs reported by the engine.
        loss_mask: per-response-token mask, 1 for model-generated tokens, 0 otherwise.
        response_text: decoded response.
        label: reference answer / ground truth (any picklable object).
        reward: scalar reward used for training.
        raw_reward: what the reward function returned before reduction (float, dict or None).
        status: one of ``SAMPLE_STATUSES``.
        weight_version: version of the policy weights that generated the response.
        metadata: free-form per-sample dict (any picklable values).
        rollout_step: training step whose rollout produced this sample.
        rollout_routed_experts: --use-rollout-routing-replay: the MoE experts the engine routed each token
            to, ``{"shape": [rows, layers * k], "b64": ...}`` (see ``relax.data.routes``), or None.
        old_logprobs, ref_logprobs, teacher_logprobs, values, advantages, returns: stage fields (see the
            module docstring), one float per response token, or None while not computed. With a
            --custom-convert-samples-to-train-data-path function the trainer's fields (old log-probs,
            advantages, returns) follow the converted sample's response.
    """

    index: int = -1
    group_index: int = -1
    prompt: Any = ""
    prompt_tokens: list[int] = field(default_factory=list)
    response_tokens: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    response_text: str = ""
    label: Any = None
    reward: float = 0.0
    raw_reward: Any = None
    status: str = STATUS_COMPLETED
    weight_version: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    rollout_step: int = 0
    rollout_routed_experts: Any = None
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    teacher_logprobs: list[float] | None = None
    values: list[float] | None = None
    advantages: list[float] | None = None
    returns: list[float] | None = None

    def __post_init__(self) -> None:
        if self.status not in SAMPLE_STATUSES:
            raise ValueError(f"Sample.status must be one of {SAMPLE_STATUSES}, got {self.status!r}")

    # ------------------------------------------------------------------ helpers
    @property
    def tokens(self) -> list[int]:
        """Prompt tokens followed by response tokens (a new list)."""
        return list(self.prompt_tokens) + list(self.response_tokens)

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_tokens)

    @property
    def total_length(self) -> int:
        return len(self.prompt_tokens) + len(self.response_tokens)

    def describe(self, place: int | None = None) -> str:
        """How error messages name this sample. During a rollout its global ``index`` is not assigned yet
        (-1, given once the step's groups are complete), so it is named by its prompt group, its `place` in
        the group when the caller knows it, the prompt's row in the data file and the rollout step."""
        if self.index >= 0:
            head = f"sample {self.index} of group {self.group_index}"
        elif place is not None:
            head = f"sample {place} of group {self.group_index}"
        else:
            head = f"a sample of group {self.group_index}"
        row = (self.metadata or {}).get("prompt_index")
        where = [f"prompt row {row}"] if row is not None else []
        return f"{head} ({', '.join(where + [f'step {self.rollout_step}'])})"

    def validate(self) -> None:
        """Check per-token field lengths agree. ``response_logprobs`` / ``loss_mask`` may be
        empty (not reported) but, when given, must match ``response_tokens``."""
        n = len(self.response_tokens)
        for name in ("response_logprobs", "loss_mask"):
            m = len(getattr(self, name))
            if m not in (0, n):
                raise ValueError(f"{self.describe()}: len({name})={m} != len(response_tokens)={n}")

    def to_dict(self) -> dict[str, Any]:
        """Shallow dict of all fields (values are not copied)."""
        return {name: getattr(self, name) for name in SAMPLE_FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        """Build a Sample from a dict; missing fields take defaults, unknown keys are an error."""
        unknown = set(data) - _SAMPLE_FIELD_SET
        if unknown:
            raise ValueError(f"Unknown Sample fields: {sorted(unknown)}")
        return cls(**data)


SAMPLE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Sample))
STAGE_FIELDS: tuple[str, ...] = ("old_logprobs", "ref_logprobs", "teacher_logprobs", "values", "advantages",
                                 "returns")
ROLLOUT_FIELDS: tuple[str, ...] = tuple(f for f in SAMPLE_FIELDS if f not in STAGE_FIELDS)
_SAMPLE_FIELD_SET = frozenset(SAMPLE_FIELDS)


def check_fields(fields: Iterable[str] | None) -> tuple[str, ...]:
    """Validate a field selection (None means all fields); returns it as a tuple in
    declaration order."""
    if fields is None:
        return SAMPLE_FIELDS
    if isinstance(fields, str):
        fields = [fields]
    wanted = set(fields)
    unknown = wanted - _SAMPLE_FIELD_SET
    if unknown:
        raise ValueError(f"Unknown Sample fields: {sorted(unknown)}; known: {list(SAMPLE_FIELDS)}")
    return tuple(f for f in SAMPLE_FIELDS if f in wanted)


def samples_to_columns(samples: Sequence[Sample], fields: Iterable[str] | None = None) -> dict[str, list[Any]]:
    """``[Sample, ...]`` -> ``{field: [value per sample]}`` (values are not copied)."""
    names = check_fields(fields)
    return {name: [getattr(s, name) for s in samples] for name in names}


def columns_to_samples(columns: dict[str, Sequence[Any]]) -> list[Sample]:
    """``{field: [value per sample]}`` -> ``[Sample, ...]``. Fields not present take defaults.
    All columns must have the same length."""
    names = check_fields(columns.keys())
    lengths = {len(columns[n]) for n in names}
    if len(lengths) > 1:
        raise ValueError(f"Columns have different lengths: { {n: len(columns[n]) for n in names} }")
    n = lengths.pop() if lengths else 0
    return [Sample(**{name: columns[name][i] for name in names}) for i in range(n)]
