"""Small synthetic tasks with an exact-match reward, generated locally.

The embedded default of Relax (``relax-train`` with no model or data flags) trains the tiny
byte-level model of :mod:`relax.models.tiny` on one of these tasks. The tiny-model tasks map a
short prompt to a one-character answer drawn from a small, fixed answer alphabet, so that

* a policy that answers in the right *format* but ignores the prompt scores exactly
  ``1 / len(answer_choices)`` (0.1 for the digit tasks): honestly low, but not zero, so GRPO
  groups contain rewarded samples from the first step;
* the prompt set is small, so the 2-layer, 64-wide model can learn the mapping from reward alone.

Rows are JSONL objects ``{"input": ..., "label": ...}``. ``input`` is, by default, a list of chat
messages (``[{"role": "user", "content": "3"}]``) for the rollout to render with the tokenizer's
chat template (``<|im_start|>user\\n3<|im_end|>\\n<|im_start|>assistant\\n``);
``prompt_format="text"`` writes the bare prompt string instead. ``label`` is the answer string.
:func:`render_prompt` is the one place that turns an ``input`` into model text; the format warm
start (:mod:`relax.models.warmstart`) uses it too, so both see the same token layout.

Tasks
-----
``successor`` (default for the tiny model)
    ``"n"`` with a digit n -> ``str((n + 1) % 10)``. 10 distinct prompts.
``copy``
    ``"n"`` with a digit n -> ``str(n)``. 10 distinct prompts.
``add_mod10``
    ``"a+b="`` with digits a, b -> ``str((a + b) % 10)``. 100 distinct prompts.
``max3``
    ``"abc"``, three digits -> the largest of them. 1000 distinct prompts.
``word_arith``
    One-step arithmetic word problems in English (add, subtract, multiply small numbers), e.g.
    ``"Anna has 3 apples. Anna gets 4 more apples. How many apples does Anna have now? Answer
    with just the number."`` -> ``"7"``. Meant for a real pretrained chat model
    (SmolLM2-135M-Instruct), not the tiny one; its reward is :func:`number_match_reward` (the
    last number in the response must equal the label).

Measured learnability on the tiny model (chat template, 40-step format warm start, a minimal
GRPO loop on CPU with :data:`TINY_GRPO_RECOMMENDED`): ``successor`` went from ~0.08 to a mean
reward above 0.8 (3-step average) after 27, 49 and 21 steps for seeds 0, 1, 2, and stayed at
0.93-0.98 afterwards. With one optimizer step per rollout instead of four it took 60-100 steps;
without the KL term one seed of three stalled at ~0.7 (some prompts collapsed onto a wrong
answer). ``add_mod10`` and ``max3`` need the answer position to combine two or more prompt
tokens through attention; even *supervised* training of the tiny model on ``add_mod10`` made no
progress in 300 Adam steps, so they are kept only as harder options, not as defaults.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

EOS_TEXT = "<|im_end|>"
DIGITS = tuple("0123456789")


@dataclass(frozen=True)
class Task:
    """A finite prompt space with one correct answer per prompt."""

    name: str
    description: str
    answers: Mapping[str, str]  # prompt -> exact answer; iteration order is fixed
    answer_choices: tuple[str, ...] = ()  # every possible answer, when the set is small
    reward: str = "exact_match"  # name in REWARDS
    prompts: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "prompts", tuple(self.answers))

    def answer(self, prompt: str) -> str:
        return self.answers[prompt]

    @property
    def chance_accuracy(self) -> float | None:
        """Accuracy of a uniform guess over ``answer_choices`` (None without a choice set)."""
        return 1.0 / len(self.answer_choices) if self.answer_choices else None


def _digit_task(name: str, description: str, prompts, fn: Callable[[str], str]) -> Task:
    return Task(name, description, {p: fn(p) for p in prompts}, DIGITS)


def _word_arith() -> dict[str, str]:
    names = ("Anna", "Ben", "Lily", "Sam", "Mia", "Tom")
    items = ("apples", "books", "pencils", "marbles", "cookies", "stickers")
    tail = " Answer with just the number."
    out: dict[str, str] = {}
    for n in names:
        for it in items:
            for a in range(2, 10):
                for b in range(2, 10):
                    out[f"{n} has {a} {it}. {n} gets {b} more {it}. "
                        f"How many {it} does {n} have now?{tail}"] = str(a + b)
            for a in range(2, 13):
                for b in range(2, a):
                    out[f"{n} has {a} {it} and gives {b} of them away. "
                        f"How many {it} does {n} have left?{tail}"] = str(a - b)
            for a in range(2, 6):
                for b in range(2, 6):
                    out[f"{n} has {a} bags with {b} {it} in each bag. "
                        f"How many {it} does {n} have in total?{tail}"] = str(a * b)
    return out


TASKS: dict[str, Task] = {
    "successor": _digit_task(
        "successor", "'n' with a digit n -> (n + 1) mod 10", DIGITS, lambda p: str((int(p) + 1) % 10)
    ),
    "copy": _digit_task("copy", "'n' with a digit n -> n", DIGITS, lambda p: p),
    "add_mod10": _digit_task(
        "add_mod10",
        "'a+b=' with digits a, b -> (a + b) mod 10",
        [f"{a}+{b}=" for a in range(10) for b in range(10)],
        lambda p: str(sum(int(x) for x in p.rstrip("=").split("+")) % 10),
    ),
    "max3": _digit_task(
        "max3",
        "three digits 'abc' -> the largest digit",
        [f"{a}{b}{c}" for a in range(10) for b in range(10) for c in range(10)],
        max,
    ),
    "word_arith": Task(
        "word_arith",
        "one-step arithmetic word problems (add, subtract, multiply), answer = a number",
        _word_arith(),
        reward="number_match",
    ),
}

DEFAULT_TASK = "successor"

# GRPO settings measured to learn DEFAULT_TASK on the tiny model (see the module docstring).
TINY_GRPO_RECOMMENDED = {
    "rollout_batch_size": 32,  # prompts per rollout
    "n_samples_per_prompt": 16,
    "max_response_len": 8,  # answers are 2 tokens: a digit and <|im_end|>
    "temperature": 1.0,
    "lr": 2e-3,  # Adam, betas (0.9, 0.999), eps 1e-8, grad clip 1.0, no weight decay
    "lr_warmup_steps": 5,  # linear, in rollout steps (so ~20 optimizer steps)
    "steps_per_rollout": 4,  # optimizer steps per rollout: global batch = 32 * 16 / 4 = 128
    "eps_clip": 0.2,
    "kl_loss_coef": 0.1,  # low-variance KL (k3) to the warm-started reference, in the loss
    "advantage": "grpo",  # (r - group mean) / (group std + 1e-6)
    "loss_agg": "token_mean",
}


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


def task_rows(
    num_prompts: int, seed: int, task: str = DEFAULT_TASK, prompt_format: str = "chat"
) -> list[dict]:
    """The rows :func:`generate_task_dataset` writes, as a list.

    Prompts are drawn by walking seeded shuffles of the whole prompt space, so every distinct
    prompt appears ``num_prompts // len(prompts)`` times or once more (uniform coverage).
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


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def number_match_reward(response: str, label: str) -> float:
    """1.0 when the last number in the response equals the (numeric) label, else 0.0.

    "The answer is 7." and "7" both match "7"; "7.0" matches "7"; "70" does not.
    """
    found = _NUMBER.findall(_strip_response(str(response)).replace(",", ""))
    if not found:
        return 0.0
    try:
        return 1.0 if float(found[-1]) == float(str(label).strip()) else 0.0
    except ValueError:
        return 0.0


REWARDS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match_reward,
    "number_match": number_match_reward,
}


def task_reward(task: str) -> Callable[[str, str], float]:
    """The reward function ``(response, label) -> float`` a task is scored with."""
    return REWARDS[get_task(task).reward]


def batch_rewards(
    responses: Sequence[str], labels: Sequence[str], reward: str = "exact_match"
) -> list[float]:
    fn = REWARDS[reward]
    return [fn(r, l) for r, l in zip(responses, labels, strict=True)]


def batch_exact_match(responses: Sequence[str], labels: Sequence[str]) -> list[float]:
    return batch_rewards(responses, labels, "exact_match")


def number_match_rm(args: Any, sample: Any) -> float:
    """`--custom-rm-path` adapter of :func:`number_match_reward` (the SmolLM2 word-problem example)."""
    response = getattr(sample, "response_text", None)
    if response is None:
        response = sample["response_text"] if isinstance(sample, dict) else ""
    label = sample.label if hasattr(sample, "label") else sample["label"]
    return number_match_reward(response, str(label))
