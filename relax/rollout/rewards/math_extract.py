"""Final-answer extraction for math rewards: the last \\boxed{...}, "the answer is ...", the last number."""

from __future__ import annotations

import re
from typing import Optional

def _match_brace(s: str, open_idx: int) -> int:
    """Index of the ``}`` closing the ``{`` at ``open_idx``; -1 when unbalanced.

    Escaped braces (``\\{``, ``\\}``) do not count, as in TeX.
    """
    depth = 0
    i = open_idx
    n = len(s)
    while i < n:
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _last_box_cmd(text: str) -> tuple[int, int]:
    """(start, end-of-command-name) of the last ``\\boxed`` or ``\\fbox``."""
    best = (-1, -1)
    for cmd in ("\\boxed", "\\fbox"):
        i = text.rfind(cmd)
        while i != -1:
            end = i + len(cmd)
            # must not be a prefix of a longer command name (e.g. \boxedtext)
            if end >= len(text) or not text[end].isalpha():
                if i > best[0]:
                    best = (i, end)
                break
            i = text.rfind(cmd, 0, i)
    return best


def last_boxed_only_string(text: Optional[str]) -> Optional[str]:
    """The last ``\\boxed{...}`` (or ``\\fbox{...}``) including the command, or None."""
    if not text:
        return None
    start, end = _last_box_cmd(text)
    if start < 0:
        return None
    j = end
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        close = _match_brace(text, j)
        if close < 0:
            return None
        return text[start : close + 1]
    # "\boxed 5" form: up to whitespace / '$'
    m = re.match(r"[^\s$]+", text[j:])
    if not m:
        return None
    return text[start : j + m.end()]


def extract_boxed(text: Optional[str]) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (nested braces handled), or None."""
    boxed = last_boxed_only_string(text)
    if boxed is None:
        return None
    _, end = _last_box_cmd(boxed)
    rest = boxed[end:].lstrip(" ")
    if rest.startswith("{"):
        return rest[1:-1].strip()
    return rest.strip()


_ANSWER_IS_RE = re.compile(r"(?:final\s+answer|answer)\s*(?:is\b\s*:?|:)\s*", re.IGNORECASE)


def extract_answer_is(text: Optional[str]) -> Optional[str]:
    """Text after the last "answer is" / "Answer:" up to the end of that sentence/line."""
    if not text:
        return None
    matches = list(_ANSWER_IS_RE.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :]
    rest = rest.split("\n", 1)[0]
    boxed = extract_boxed(rest)
    if boxed is not None:
        return boxed
    # a sentence end: ". " followed by more text, or a trailing period
    m = re.search(r"\.\s+(?=\S)", rest)
    if m:
        rest = rest[: m.start()]
    rest = rest.strip().strip("*").strip()
    rest = re.sub(r"\.$", "", rest).strip()
    return rest or None


_NUMBER_RE = re.compile(
    r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+"
)


def extract_last_number(text: Optional[str]) -> Optional[str]:
    if not text:
        return None
    found = _NUMBER_RE.findall(text)
    if not found:
        return None
    return found[-1].replace(" ", "")


def extract_math_answer(text: Optional[str]) -> Optional[str]:
    """Last ``\\boxed{}``, else "answer is ..."/"Answer: ...", else the last number."""
    if not text:
        return None
    for extractor in (extract_boxed, extract_answer_is, extract_last_number):
        ans = extractor(text)
        if ans is not None and ans != "":
            return ans
    return None


