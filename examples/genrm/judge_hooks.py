"""A judge prompt a 135M-parameter model can answer: --genrm-template-path / --genrm-parser-path of the GenRM
example (examples/genrm/run.sh).

The default judge template asks for a short reasoning and a `\\boxed{score}`; SmolLM2-135M-Instruct never writes
one (measured: every verdict unparseable, see the example's README section), so this template asks a yes/no
question and the parser reads the first "yes" or "no" of the reply.
"""

from __future__ import annotations

import re
from typing import Any, Optional

_WORD = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def _question(prompt: Any) -> str:
    if isinstance(prompt, (list, tuple)):
        return "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, dict) and m.get("role") == "user")
    return str(prompt)


def yes_no_template(prompt: Any, response: str, label: Any = None, metadata: Optional[dict] = None) -> list[dict]:
    """Chat messages: the problem, the correct answer, the response; asks whether they agree (Yes or No)."""
    reference = f"The correct answer is {label}.\n" if label is not None else ""
    return [{"role": "user", "content": (
        f"Problem: {_question(prompt)}\n{reference}Student's answer: {response.strip()}\n\n"
        "Is the student's answer correct? Reply with one word: Yes or No.")}]


def yes_no_parser(text: str) -> Optional[float]:
    """1.0 for a reply whose first yes/no word is "yes", 0.0 for "no"; None (unparseable) without either."""
    found = _WORD.search(text or "")
    if found is None:
        return None
    return 1.0 if found.group(1).lower() == "yes" else 0.0
