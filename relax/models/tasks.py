"""Small synthetic tasks with an exact-match reward, generated locally.

The embedded default of Relax (``relax-train`` with no model or data flags) trains the tiny
byte-level model of :mod:`relax.models.tiny` on one of these tasks. Every task maps a short
prompt to a one-character answer drawn from a small, fixed answer alphabet, so that

* a policy that answers in the right *format* but ignores the prompt scores exactly
  ``1 / len(answer_choices)`` (0.1 for the digit tasks): honestly low, but not zero, so GRPO
  groups contain some rewarded samples from the first step;
* the prompt set is small (tens to a hundred distinct prompts), so a 2-layer model can learn the
  mapping from reward alone within ~100 GRPO steps on CPU.

Rows are JSONL objects ``{"input": ..., "label": ...}``. ``input`` is, by default, a list of chat
messages (``[{"role": "user", "content": "3+4="}]``) for the rollout to render with the tokenizer's
chat template; ``prompt_format="text"`` writes the bare prompt string instead. ``label`` is the
answer string. :func:`render_prompt` is the one place that turns an ``input`` into model text; the
format warm start (:mod:`relax.models.warmstart`) uses it too, so both see the same token layout.

Tasks
-----
``add_mod10`` (default)
    ``"a+b="`` with digits a, b in 0..9 -> ``str((a + b) % 10)``. 100 distinct prompts.
``successor``
    ``"n"`` with a digit n -> ``str((n + 1) % 10)``. 10 distinct prompts (easiest; smoke tests).
``copy``
    ``"n"`` with a digit n -> ``str(n)``. 10 distinct prompts.
``max3``
    ``"abc"``, three digits -> the largest of them. 1000 distinct prompts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

EOS_TEXT = "<|im_end|>"
DIGITS = tuple("0123456789")


@dataclass(frozen=True)
class Task:
    """A finite prompt space with a deterministic answer for each prompt."""

    name: str
    description: str
    prompts: tuple[str, ...]  # every distinct prompt, in a fixed order
    answer: Callable[[str], str]  # prompt -> exact answer
    answer_choices: tuple[str, ...]  # every possible answer; chance = 1 / len(answer_choices)

    @property
    def chance_accuracy(self) -> float:
        return 1.0 / len(self.answer_choices)


def _add_mod10(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    return str((int(a) + int(b)) % 10)


def _successor(prompt: str) -> str:
    return str((int(prompt) + 1) % 10)


def _copy(prompt: str) -> str:
    return prompt


def _max3(prompt: str) -> str:
    return max(prompt)


TASKS: dict[str, Task] = {
    "add_mod10": Task(
        name="add_mod10",
        description="'a+b=' with digits a, b -> (a + b) mod 10",
        prompts=tuple(f"{a}+{b}=" for a in range(10) for b in range(10)),
        answer=_add_mod10,
        answer_choices=DIGITS,
    ),
    "successor": Task(
        name="successor",
        description="'n' with a digit n -> (n + 1) mod 10",
        prompts=DIGITS,
        answer=_successor,
        answer_choices=DIGITS,
    ),
    "copy": Task(
        name="copy",
        description="'n' with a digit n -> n",
        prompts=DIGITS,
        answer=_copy,
        answer_choices=DIGITS,
    ),
    "max3": Task(
        name="max3",
        description="three digits 'abc' -> the largest digit",
        prompts=tuple(f"{a}{b}{c}" for a in range(10) for b in range(10) for c in range(10)),
        answer=_max3,
        answer_choices=DIGITS,
    ),
}

DEFAULT_TASK = "add_mod10"


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}") from None


def make_input(prompt: str, prompt_format: str = "chat") -> Any:
    """The dataset ``input`` for a bare prompt: chat messages (default) or the bare string."""
    if prompt_format == "chat":
        return [{"role": "user", "content": prompt}]
    if prompt_format == "text":
        return prompt
    raise ValueError(f"unknown prompt_format {prompt_format!r} (chat, text)")


def render_prompt(tokenizer, inp: Any) -> str:
    """Model text for a dataset ``input``.

    Chat messages go through the tokenizer's chat template with the generation prompt appended
    (``...<|im_start|>assistant\\n``); a plain string is used as is.
    """
    if isinstance(inp, str):
        return inp
    return tokenizer.apply_chat_template(list(inp), tokenize=False, add_generation_prompt=True)


def task_rows(num_prompts: int, seed: int, task: str = DEFAULT_TASK, prompt_format: str = "chat") -> list[dict]:
    """The rows :func:`generate_task_dataset` writes, as a list.

    Prompts are drawn by walking seeded shuffles of the whole prompt space, so every distinct
    prompt appears ``num_prompts // len(prompts)`` or one more times (uniform coverage).
    """
    if num_prompts < 0:
        raise ValueError("num_prompts must be >= 0")
    spec = get_task(task)
    rng = random.Random(f"relax-task:{task}:{seed}")
    rows: list[dict] = []
    while len(rows) < num_prompts:
        order = list(spec.prompts)
        rng.shuffle(order)
        for prompt in order[: num_prompts - len(rows)]:
            rows.append({"input": make_input(prompt, prompt_format), "label": spec.answer(prompt)})
    return rows


def generate_task_dataset(
    path: str | Path,
    num_prompts: int,
    seed: int,
    task: str = DEFAULT_TASK,
    prompt_format: str = "chat",
) -> Path:
    """Write ``num_prompts`` JSONL rows ``{"input": ..., "label": ...}`` for ``task`` to ``path``.

    Deterministic given (num_prompts, seed, task, prompt_format): same arguments, same bytes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = task_rows(num_prompts, seed, task, prompt_format)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    return path


def _strip_response(text: str) -> str:
    text = text.strip()
    while text.endswith(EOS_TEXT):
        text = text[: -len(EOS_TEXT)].strip()
    return text


def exact_match_reward(response: str, label: str) -> float:
    """1.0 when the response equals the label, else 0.0.

    Surrounding whitespace and a trailing ``<|im_end|>`` (when the rollout decodes special
    tokens) are ignored; nothing else is: "7." or "77" against "7" score 0.
    """
    return 1.0 if _strip_response(str(response)) == str(label).strip() else 0.0


def batch_exact_match(responses: Sequence[str], labels: Sequence[str]) -> list[float]:
    return [exact_match_reward(r, l) for r, l in zip(responses, labels, strict=True)]
