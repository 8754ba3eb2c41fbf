"""What a prompt row must be for the flags it is trained with: one definition of each check.

The rollout calls these where it uses a row (rendering the prompt: `relax.rollout.prompts`; sending its images:
`relax.rollout.multimodal`; scoring it: `relax.rollout.rewards.registry` and `.builtin`), and the checks before
a run (`relax.core.preflight`) call the same functions on every row of the prompt files, so a row the rollout
would reject at step 0 is named by file:line before Ray starts. Each check returns None for a good row, else a
`RowProblem`: what is wrong, the flag it concerns and the fix.

This module imports nothing of Relax: the data, rollout and core layers all import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["RowProblem", "BOXED_PREFIX", "LABEL_REWARDS", "messages_problem", "prompt_problem", "rm_type_problem",
           "resolve_rm_type", "label_problem", "reward_label_problem", "multimodal_problem"]

BOXED_PREFIX = "boxed_"  # boxed_<type>: the last \boxed{} of the response, scored with <type>
# Built-in rewards that compare the response with the row's label (string, number, or a list of them).
LABEL_REWARDS = frozenset({"exact_match", "math", "dapo", "deepscaler", "f1", "gpqa", "multiple_choice"})


def _kind(value: Any) -> str:
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


@dataclass(frozen=True)
class RowProblem:
    what: str  # what is wrong with the row
    flag: str  # the flag the row disagrees with
    fix: str

    def __str__(self) -> str:
        return f"{self.what} ({self.flag}); {self.fix}"


# --------------------------------------------------------------------------- prompt


def messages_problem(prompt: list) -> Optional[str]:
    """Why a list prompt is not a list of chat messages (None: it is)."""
    for i, m in enumerate(prompt):
        if not isinstance(m, dict):
            return f"a list prompt must hold message objects; item {i} is {_kind(m)}"
    return None


def _json_messages(text: str) -> bool:
    """A message list stored as a JSON string (as Parquet exports often hold it)."""
    s = text.lstrip()
    if not s.startswith("[") or '"role"' not in s:
        return False
    try:
        value = json.loads(s)
    except ValueError:
        return False
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def prompt_problem(prompt: Any, apply_chat_template: bool) -> Optional[RowProblem]:
    """A prompt the rollout cannot render with the chat template on or off (`relax.rollout.prompts`)."""
    if isinstance(prompt, tuple):
        prompt = list(prompt)
    if isinstance(prompt, list):
        bad = messages_problem(prompt)
        if bad:
            return RowProblem(bad, "--input-key", 'write each message as {"role": ..., "content": ...}')
        if not apply_chat_template:
            return RowProblem("a message-list prompt needs the chat template",
                              "--apply-chat-template", "add --apply-chat-template (or write the prompts as strings)")
        return None
    if not isinstance(prompt, str):
        return RowProblem(f"the prompt is {_kind(prompt)}", "--input-key",
                          "the prompt must be a string or a list of chat messages")
    if _json_messages(prompt):
        return RowProblem("the prompt is a string holding a JSON message list, where a message list is required",
                          "--apply-chat-template" if apply_chat_template else "--input-key",
                          "store the messages as a JSON array, not as a string (the chat template would render "
                          "the JSON text as one user message)")
    return None


# --------------------------------------------------------------------------- reward


def rm_type_problem(flag_value: Optional[str], metadata: Optional[dict]) -> Optional[RowProblem]:
    if (metadata or {}).get("rm_type") or flag_value:
        return None
    return RowProblem("no reward type", "--rm-type", "set --rm-type (e.g. --rm-type exact_match) or "
                      "--custom-rm-path, or give the row a metadata.rm_type")


def resolve_rm_type(flag_value: Optional[str], metadata: Optional[dict]) -> str:
    """``metadata["rm_type"]`` when set (per-sample override), else the flag value."""
    problem = rm_type_problem(flag_value, metadata)
    if problem:
        raise ValueError(f"{problem.what}: {problem.fix}")
    return str((metadata or {}).get("rm_type") or flag_value)


def _readable(value: Any) -> bool:
    return isinstance(value, (str, int, float))


def label_problem(label: Any) -> Optional[str]:
    """Why a built-in reward of `LABEL_REWARDS` cannot read `label` (None: it can; a missing label scores 0 and
    is counted by the preflight as a warning)."""
    if label is None or _readable(label):
        return None
    if isinstance(label, (list, tuple)) and label and all(x is None or _readable(x) for x in label):
        return None
    shown = "an empty list" if isinstance(label, (list, tuple)) and not label else _kind(label)
    return f"the label is {shown}; this reward compares the answer with a string or a number (or a list of them)"


def reward_label_problem(rm_type: str, label: Any) -> Optional[RowProblem]:
    base = rm_type[len(BOXED_PREFIX):] if rm_type.startswith(BOXED_PREFIX) else rm_type
    if base not in LABEL_REWARDS:
        return None
    bad = label_problem(label)
    return RowProblem(bad, f"--rm-type {rm_type}", "write the label as a string (or a list of accepted answers), "
                      "pick --label-key of such a field, or use --custom-rm-path") if bad else None


# --------------------------------------------------------------------------- multimodal


def _media_problem(item: Any) -> Optional[str]:
    if isinstance(item, str):
        return None if item.strip() else "an empty string"
    if isinstance(item, dict):
        try:
            json.dumps(item)
        except (TypeError, ValueError):
            return "an object that JSON cannot carry (raw bytes?)"
        return None
    return _kind(item)


def multimodal_problem(modality: str, value: Any) -> Optional[RowProblem]:
    """A --multimodal-keys value SGLang's /generate cannot take as its `<modality>_data`: that is a path, URL or
    base64 data URL (or an object SGLang reads), or a non-empty list of them."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    bad = "an empty list" if not items else next(filter(None, map(_media_problem, items)), None)
    if bad is None:
        return None
    return RowProblem(f"the {modality} value is {bad}", "--multimodal-keys",
                      f"store each {modality} as a path, URL or base64 data URL (or a list of them)")
