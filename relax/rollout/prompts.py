"""Turning a prompt (a string or a list of chat messages) into prompt token ids.

With the chat template on (default), a string prompt becomes one user message;
``system_prompt``, when given, is prepended as a system message (unless the
messages already start with one, which is kept as is); the template is rendered
with ``add_generation_prompt=True`` plus ``chat_template_kwargs`` (e.g.
``{"enable_thinking": False}``) and the record's ``tools``.

With the chat template off, a string prompt is used as is, preceded by
``system_prompt + system_separator`` when a system prompt is given; a message
list is an error (it has no plain-text form).

The rendered text is encoded with ``add_special_tokens=False`` by default (chat
templates already contain any BOS they want).

``PromptEncoder`` adds ``max_prompt_len`` filtering: ``encode_or_none`` returns
None for a prompt longer than ``max_prompt_len`` tokens and counts it in
``stats()["filtered_long_prompts"]``.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence, Union

from relax.formats.row_checks import prompt_problem

__all__ = ["render_prompt", "encode_prompt", "PromptEncoder"]

Prompt = Union[str, Sequence[dict]]


def _prompt_and_tools(prompt_or_record: Any, tools: Any) -> tuple[Prompt, Any]:
    # a PromptRecord (or anything with .prompt) or a bare prompt
    if hasattr(prompt_or_record, "prompt") and not isinstance(prompt_or_record, (str, list, tuple)):
        rec_tools = getattr(prompt_or_record, "tools", None)
        return prompt_or_record.prompt, tools if tools is not None else rec_tools
    return prompt_or_record, tools


def render_prompt(
    prompt: Any,
    tokenizer: Any = None,
    *,
    apply_chat_template: bool = True,
    system_prompt: Optional[str] = None,
    tools: Optional[list] = None,
    chat_template_kwargs: Optional[dict] = None,
    system_separator: str = "\n",
) -> str:
    """The prompt text (see module doc). ``prompt`` may be a ``PromptRecord``."""
    prompt, tools = _prompt_and_tools(prompt, tools)
    problem = prompt_problem(prompt, apply_chat_template)  # the preflight runs the same check on every row
    if problem:
        raise TypeError(str(problem))
    if apply_chat_template:
        if tokenizer is None:
            raise ValueError("apply_chat_template=True needs a tokenizer")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": system_prompt})
        kwargs = {"add_generation_prompt": True}
        kwargs.update(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
        return text
    if system_prompt:
        return f"{system_prompt}{system_separator}{prompt}"
    return prompt


def encode_prompt(
    prompt: Any,
    tokenizer: Any,
    *,
    apply_chat_template: bool = True,
    system_prompt: Optional[str] = None,
    tools: Optional[list] = None,
    chat_template_kwargs: Optional[dict] = None,
    system_separator: str = "\n",
    add_special_tokens: bool = False,
) -> list[int]:
    """Prompt token ids: ``tokenizer.encode(render_prompt(...), add_special_tokens=...)``."""
    text = render_prompt(
        prompt,
        tokenizer,
        apply_chat_template=apply_chat_template,
        system_prompt=system_prompt,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        system_separator=system_separator,
    )
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


class PromptEncoder:
    """A tokenizer plus prompt options, with ``max_prompt_len`` filtering and counts."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        apply_chat_template: bool = True,
        system_prompt: Optional[str] = None,
        chat_template_kwargs: Optional[dict] = None,
        max_prompt_len: Optional[int] = None,
        system_separator: str = "\n",
        add_special_tokens: bool = False,
    ) -> None:
        if max_prompt_len is not None and max_prompt_len <= 0:
            raise ValueError(f"max_prompt_len must be positive, got {max_prompt_len}")
        self.tokenizer = tokenizer
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_prompt_len = max_prompt_len
        self.system_separator = system_separator
        self.add_special_tokens = add_special_tokens
        self._lock = threading.Lock()
        self._encoded = 0
        self._filtered = 0

    @classmethod
    def from_args(cls, args: Any, tokenizer: Any, **overrides: Any) -> "PromptEncoder":
        """From flags: ``apply_chat_template``, ``apply_chat_template_kwargs``, ``system_prompt``,
        ``rollout_max_prompt_len``."""
        kw = dict(
            apply_chat_template=bool(args.apply_chat_template),
            chat_template_kwargs=args.apply_chat_template_kwargs or {},
            system_prompt=args.system_prompt,
            max_prompt_len=args.rollout_max_prompt_len,
        )
        kw.update(overrides)
        return cls(tokenizer, **kw)

    def render(self, prompt: Any) -> str:
        return render_prompt(
            prompt,
            self.tokenizer,
            apply_chat_template=self.apply_chat_template,
            system_prompt=self.system_prompt,
            chat_template_kwargs=self.chat_template_kwargs,
            system_separator=self.system_separator,
        )

    def encode(self, prompt: Any) -> list[int]:
        """Token ids, whatever their length."""
        return list(self.tokenizer.encode(self.render(prompt), add_special_tokens=self.add_special_tokens))

    def fits(self, ids_or_prompt: Any) -> bool:
        """Whether a prompt (or its ids) is within ``max_prompt_len``; does not count."""
        if self.max_prompt_len is None:
            return True
        ids = ids_or_prompt if isinstance(ids_or_prompt, list) and all(isinstance(i, int) for i in ids_or_prompt) else self.encode(ids_or_prompt)
        return len(ids) <= self.max_prompt_len

    def encode_or_none(self, prompt: Any) -> Optional[list[int]]:
        """Token ids, or None (counted as a filtered long prompt) when over ``max_prompt_len``."""
        ids = self.encode(prompt)
        with self._lock:
            if self.max_prompt_len is not None and len(ids) > self.max_prompt_len:
                self._filtered += 1
                return None
            self._encoded += 1
        return ids

    def filter_records(self, records: Sequence[Any]) -> list[Any]:
        """The records whose prompts fit (the others are counted)."""
        return [r for r in records if self.encode_or_none(r) is not None]

    def stats(self) -> dict:
        with self._lock:
            return {"encoded_prompts": self._encoded, "filtered_long_prompts": self._filtered}
