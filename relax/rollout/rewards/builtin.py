"""Built-in reward functions: ``fn(response: str, label, metadata: dict) -> float``.

Labels may be a single value or a list/tuple of acceptable values (any match
counts) for every function here. The functions that compare with the label refuse one they cannot read (a dict,
say) with a TypeError: `relax.formats.row_checks.label_problem`, which the preflight runs on every row.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from collections import Counter
from typing import Any, Optional

from relax.formats.row_checks import label_problem
from relax.rollout.rewards.math_grader import (
    extract_boxed,
    extract_math_answer,
    grade_answer,
    normalize_answer,
)

__all__ = [
    "exact_match_reward",
    "math_reward",
    "dapo_reward",
    "deepscaler_reward",
    "f1_reward",
    "multiple_choice_reward",
    "gpqa_reward",
    "random_reward",
    "extract_choice_letter",
    "strip_thinking",
]


def _check_label(label: Any) -> None:
    problem = label_problem(label)
    if problem:
        raise TypeError(problem)


def _labels(label: Any) -> list:
    _check_label(label)
    if isinstance(label, (list, tuple)):
        return list(label)
    return [label]


def strip_thinking(response: str) -> str:
    """The part after the last ``</think>`` (the whole response when there is none)."""
    if "</think>" in response:
        return response.rsplit("</think>", 1)[1]
    return response


# --------------------------------------------------------------------------- exact match


def exact_match_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """1.0 when ``response.strip() == str(label).strip()`` for any label, else 0.0."""
    resp = str(response).strip()
    return 1.0 if any(resp == str(lab).strip() for lab in _labels(label) if lab is not None) else 0.0


# --------------------------------------------------------------------------- math family


def math_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """1.0 when the final answer is equivalent to the label, else 0.0.

    The answer is the last ``\\boxed{}`` after any ``</think>``, else the text after
    the last "answer is"/"Answer:", else the last number. A label written as
    ``\\boxed{...}`` is unwrapped.
    """
    _check_label(label)
    pred = extract_math_answer(strip_thinking(str(response)))
    if pred is None:
        return 0.0
    return 1.0 if grade_answer(pred, label) else 0.0


_DAPO_ANSWER_RE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)


def dapo_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """DAPO-style: the last ``Answer: <x>`` line; +1.0 when correct, -1.0 otherwise.

    Only the tail of the response is searched (``metadata["dapo_tail_chars"]``,
    default 300 characters, as DAPO does); answers are compared with ``is_equiv``.
    """
    _check_label(label)
    metadata = metadata or {}
    tail_chars = int(metadata.get("dapo_tail_chars", 300) or 0)
    text = strip_thinking(str(response))
    if tail_chars > 0:
        text = text[-tail_chars:]
    matches = _DAPO_ANSWER_RE.findall(text)
    if not matches:
        return -1.0
    pred = matches[-1].strip()
    boxed = extract_boxed(pred)
    if boxed is not None:
        pred = boxed
    return 1.0 if grade_answer(pred, label) else -1.0


def deepscaler_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """DeepScaleR-style: 1.0 when the last ``\\boxed{}`` after ``</think>`` is correct, else 0.0.

    A response that opens ``<think>`` but never closes it (truncated reasoning)
    scores 0.0; a response with no think tags at all is graded as a whole. No
    ``\\boxed{}`` answer scores 0.0.
    """
    text = str(response)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    elif "<think>" in text:
        return 0.0
    pred = extract_boxed(text)
    if pred is None or pred == "":
        return 0.0
    for lab in _labels(label):
        if lab is None:
            continue
        gold = extract_boxed(str(lab))
        if grade_answer(pred, gold if gold is not None else lab):
            return 1.0
    return 0.0


# --------------------------------------------------------------------------- F1


def _f1_tokens(text: str) -> list[str]:
    text = str(text).lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def f1_score(prediction: str, gold: str) -> float:
    pred_toks, gold_toks = _f1_tokens(prediction), _f1_tokens(gold)
    if not pred_toks and not gold_toks:
        return 1.0
    if not pred_toks or not gold_toks:
        return 0.0
    common = Counter(pred_toks) & Counter(gold_toks)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_toks), same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def f1_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """Token-level F1 (SQuAD normalization: lowercase, no punctuation/articles), max over labels.

    The text after ``</think>`` is scored; if it contains "Answer:" only the part after the
    last one is used.
    """
    text = strip_thinking(str(response))
    m = list(re.finditer(r"answer\s*:", text, re.IGNORECASE))
    if m:
        text = text[m[-1].end() :]
    labels = [lab for lab in _labels(label) if lab is not None]
    if not labels:
        return 0.0
    return max(f1_score(text, str(lab)) for lab in labels)


# --------------------------------------------------------------------------- multiple choice


def _letters(n: int) -> str:
    return string.ascii_uppercase[: max(1, min(n, 26))]


def extract_choice_letter(response: str, valid: str = "ABCD") -> Optional[str]:
    """The chosen option letter in ``response``, or None.

    Tries, in order: the last ``\\boxed{}`` (``\\boxed{B}``, ``\\boxed{\\text{(B)}}``);
    the last "answer is (B)" / "Answer: B"; a response that is just a letter; the last
    parenthesized letter ``(B)``; the last standalone capital letter.
    """
    text = strip_thinking(str(response))
    cls = "[" + re.escape(valid) + "]"

    def letter_of(s: str) -> Optional[str]:
        s = normalize_answer(s)
        m = re.fullmatch(r"\(?\s*(" + cls + r")\s*\)?[.:)]?(?:\s.*)?", s, re.IGNORECASE | re.DOTALL)
        if m and m.group(1).upper() in valid:
            return m.group(1).upper()
        return None

    boxed = extract_boxed(text)
    if boxed is not None:
        got = letter_of(boxed)
        if got:
            return got
    ans = list(re.finditer(r"(?:answer|option|choice)\s*(?:is)?\s*:?\s*\**\s*\(?(" + cls + r")\b\)?", text, re.IGNORECASE))
    if ans:
        letter = ans[-1].group(1).upper()
        if letter in valid:
            return letter
    stripped = text.strip()
    got = letter_of(stripped) if len(stripped) <= 4 else None
    if got:
        return got
    paren = re.findall(r"\((" + cls + r")\)", text)
    if paren:
        return paren[-1]
    lone = re.findall(r"(?<![A-Za-z])(" + cls + r")(?![A-Za-z])", text)
    if lone:
        return lone[-1]
    return None


def _choices(metadata: dict) -> Optional[list[str]]:
    ch = metadata.get("choices") if metadata else None
    if ch is None:
        return None
    if isinstance(ch, dict):
        return [str(ch[k]) for k in sorted(ch)]
    return [str(c) for c in ch]


def _gold_letter(label: Any, metadata: dict, valid: str) -> Optional[str]:
    """The correct letter from the label (a letter or the correct choice's text)."""
    if metadata and metadata.get("correct_letter"):
        return str(metadata["correct_letter"]).strip().upper()
    if label is None:
        return None
    if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(valid):
        return valid[label]
    lab = str(label).strip()
    m = re.fullmatch(r"\(?([A-Za-z])\)?\.?", lab)
    if m and m.group(1).upper() in valid:
        return m.group(1).upper()
    choices = _choices(metadata)
    if choices:
        for i, c in enumerate(choices):
            if c.strip().casefold() == lab.casefold():
                return valid[i]
    return None


def multiple_choice_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """1.0 when the chosen letter is the correct one, else 0.0.

    Options: ``metadata["choices"]`` (list, or dict letter->text) sets the valid letters
    (A.. for as many choices) and lets the label be the correct choice's text and the
    response name the choice's text instead of a letter; ``metadata["valid_letters"]``
    overrides the letters; ``metadata["correct_letter"]`` overrides the label.
    """
    metadata = metadata or {}
    choices = _choices(metadata)
    valid = str(metadata.get("valid_letters") or (_letters(len(choices)) if choices else "ABCD")).upper()
    golds = {g for g in (_gold_letter(lab, metadata, valid) for lab in _labels(label)) if g}
    if not golds:
        return 0.0
    picked = extract_choice_letter(response, valid)
    if picked is None and choices:
        text = normalize_answer(extract_boxed(strip_thinking(str(response))) or strip_thinking(str(response)))
        for i, c in enumerate(choices):
            if normalize_answer(c).casefold() == text.casefold():
                picked = valid[i]
                break
    return 1.0 if picked is not None and picked in golds else 0.0


def gpqa_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """GPQA: four options A-D (unless ``metadata`` gives choices); see ``multiple_choice_reward``."""
    return multiple_choice_reward(response, label, metadata)


# --------------------------------------------------------------------------- random


def random_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """A reproducible coin flip: 0.0 or 1.0, determined by ``metadata["seed"]`` (default 0),
    the response and the label. Useful for pipeline tests and as a baseline."""
    metadata = metadata or {}
    seed = metadata.get("seed", metadata.get("random_seed", 0))
    key = f"{seed}\x00{response}\x00{label}".encode("utf-8", "surrogatepass")
    rng = random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))
    return float(rng.randint(0, 1))
