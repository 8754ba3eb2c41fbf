r"""The GenRM judge: a sample whose reward type is `genrm` (--rm-type genrm, or metadata["rm_type"]) is scored by
the generative reward model's engines (--genrm-model-path; relax.roles.genrm starts them).

One judgment:
  1. the template turns the sample into a judge request: `template(prompt, response, label, metadata)` returns
     a list of chat messages, rendered with the GenRM model's chat template (its tokenizer, with the generation
     prompt), or a string used as the judge's prompt text as it is;
  2. the request goes to the GenRM router's /generate with --genrm-sampling-config (temperature 0.1, top_p 1.0,
     top_k -1, max_response_len 4096 by default);
  3. the parser turns the judge's text into a score: `parser(text) -> float`; None, or an exception, means the
     verdict cannot be parsed.

Default template (`default_template`): a system message asking for a strict grade, and a user message with the
question (a message-list prompt as `role: content` lines), the reference answer when the sample has a label, and
the response; it asks for a short reasoning and a score from 0 to 1 as the last thing written, as `\boxed{score}`.

Default parser (`default_parser`): the last `\boxed{...}` of the text, read as a number (`0.7`, `1`, `3/4`) or
as a verdict word (yes/correct/true -> 1.0, no/incorrect/false -> 0.0); without a `\boxed{}`, a last non-empty
line that is only "Yes" or "No" (optionally after "Verdict:", "Answer:" or "Final answer:", markdown and a final
period ignored) gives 1.0 / 0.0. Anything else is unparseable. Numbers are used as given (not clipped).

Replace either with Relax's own flags --genrm-template-path / --genrm-parser-path (dotted paths).

A verdict that cannot be parsed, or a judge request that fails, raises: the reward runner then applies
--reward-error-policy (fail: stop the run naming the sample; zero: score 0.0, mark metadata["reward_error"],
count it), never a silent zero. Each judgment's verdict (its first 2000 characters) is kept in
metadata["genrm_verdict"]. `GenRMJudge.take_metrics()` gives the step metrics: genrm/judgments,
genrm/latency_mean, genrm/latency_max (seconds per judge request), genrm/parse_failures and
genrm/request_failures.
"""

from __future__ import annotations

import math
import re
import threading
import time
from typing import Any, Callable, Optional

import aiohttp

from relax.rollout.generate import engine_reply, generate_payload, post_generate
from relax.config.genrm_options import request_sampling, sampling_config
from relax.rollout.prompts import render_prompt
from relax.rollout.rewards.custom import import_by_path
from relax.rollout.rewards.math_grader import extract_boxed

__all__ = ["GENRM_TYPE", "GenRMJudge", "GenRMParseError", "default_parser", "default_template", "active_judge",
           "set_active_judge", "load_genrm_hook"]

GENRM_TYPE = "genrm"
VERDICT_KEEP_CHARS = 2000

SYSTEM_PROMPT = ("You are a strict and fair grader. You judge whether a response answers a question correctly "
                 "and completely.")
JUDGE_INSTRUCTIONS = ("Judge the response{reference}. Reason briefly, then write your score from 0 (wrong) to 1 "
                      "(correct) as the last thing in your reply, in the form \\boxed{{score}}: \\boxed{{1}} for "
                      "a correct response, \\boxed{{0}} for a wrong one.")

_YES = {"yes", "correct", "true", "right"}
_NO = {"no", "incorrect", "false", "wrong"}
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_FRACTION = re.compile(r"^([+-]?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)$")
_LINE_PREFIX = re.compile(r"^(final\s+answer|final\s+verdict|verdict|answer|judgement|judgment)\s*[:\-]\s*", re.I)


class GenRMParseError(ValueError):
    """The judge's reply holds no score the parser can read."""


class GenRMRequestError(RuntimeError):
    """The judge request to the GenRM engines failed."""


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, (list, tuple)):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
                         for m in prompt)
    return "" if prompt is None else str(prompt)


def default_template(prompt: Any, response: str, label: Any = None, metadata: Optional[dict] = None) -> list[dict]:
    """The default judge request (see the module doc): chat messages."""
    has_label = label is not None and str(label).strip() != ""
    parts = [f"Question:\n{_prompt_text(prompt)}"]
    if has_label:
        parts.append(f"Reference answer:\n{label}")
    parts.append(f"Response:\n{response}")
    parts.append(JUDGE_INSTRUCTIONS.format(reference=" against the reference answer" if has_label else ""))
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n\n".join(parts)}]


def _score_word(text: str) -> Optional[float]:
    word = text.strip().strip("*_`.! ").lower()
    if word.startswith("\\text{") and word.endswith("}"):
        word = word[len("\\text{"):-1].strip()
    if word in _YES:
        return 1.0
    if word in _NO:
        return 0.0
    return None


def default_parser(text: str) -> float:
    """The default verdict parser (see the module doc); raises GenRMParseError when there is no score."""
    text = "" if text is None else str(text)
    boxed = extract_boxed(text)
    if boxed is not None:
        value = boxed.strip()
        if _NUMBER.match(value):
            return float(value)
        fraction = _FRACTION.match(value)
        if fraction and float(fraction.group(2)) != 0:
            return float(fraction.group(1)) / float(fraction.group(2))
        word = _score_word(value)
        if word is not None:
            return word
        raise GenRMParseError(f"the last \\boxed{{}} holds no score: {value[:100]!r}")
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if lines:
        word = _score_word(_LINE_PREFIX.sub("", lines[-1].strip("*_`# ")))
        if word is not None:
            return word
    tail = text.strip()[-120:]
    raise GenRMParseError(f"no \\boxed{{score}} and no final Yes/No line in the verdict (ends with {tail!r})")


def load_genrm_hook(path: Optional[str], flag: str, default: Callable) -> Callable:
    """The function a --genrm-*-path flag names (the default when unset); errors name the flag."""
    if not path:
        return default
    try:
        fn = import_by_path(path)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if not callable(fn):
        raise TypeError(f"{flag}: {path!r} is not callable")
    return fn


class GenRMJudge:
    """Scores samples with the GenRM engines behind `router_url` (see the module doc). Thread-safe counters:
    the rollout's event loop judges while the manager's other threads may read the metrics."""

    def __init__(self, router_url: str, tokenizer: Any, *, sampling: Optional[dict] = None,
                 template: Optional[Callable] = None, parser: Optional[Callable] = None,
                 timeout_s: float = 600.0, retries: int = 2):
        self.router_url = router_url
        self.tokenizer = tokenizer
        self.config = sampling_config(sampling)
        self.sampling = request_sampling(self.config)
        self.template = template or default_template
        if self.template is default_template and not getattr(tokenizer, "chat_template", None):
            # found at start-up, not as one reward failure per sample
            raise ValueError("the GenRM model's tokenizer has no chat template, which the default judge template "
                             "needs: give --genrm-template-path a function that returns the judge prompt as a string")
        self.parser = parser or default_parser
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self._lock = threading.Lock()
        self._latencies: list[float] = []
        self._parse_failures = 0
        self._request_failures = 0
        self.totals = {"judgments": 0, "parse_failures": 0, "request_failures": 0}

    @classmethod
    def from_args(cls, args: Any, router_url: str, tokenizer: Any) -> "GenRMJudge":
        return cls(router_url, tokenizer, sampling=args.genrm_sampling_config,
                   template=load_genrm_hook(getattr(args, "genrm_template_path", None), "--genrm-template-path",
                                            default_template),
                   parser=load_genrm_hook(getattr(args, "genrm_parser_path", None), "--genrm-parser-path",
                                          default_parser),
                   timeout_s=float(args.generate_timeout))

    # ------------------------------------------------------------------ one judgment
    def request_ids(self, sample: Any) -> list[int]:
        """The judge request's token ids for `sample` (the template, then the GenRM model's chat template)."""
        metadata = _get(sample, "metadata") or {}
        response = _get(sample, "response_text")
        if response is None:
            response = _get(sample, "response") or ""
        request = self.template(_get(sample, "prompt"), str(response), _get(sample, "label"), metadata)
        if isinstance(request, str):
            text = request
        elif isinstance(request, (list, tuple)):
            text = render_prompt(list(request), self.tokenizer, apply_chat_template=True)
        else:
            raise TypeError(f"the GenRM template must return chat messages or a string, got {type(request).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def ajudge(self, sample: Any) -> float:
        ids = self.request_ids(sample)
        t0 = time.monotonic()
        try:
            async with aiohttp.ClientSession() as session:
                body = await post_generate(session, self.router_url, generate_payload(ids, self.sampling),
                                           timeout_s=self.timeout_s, retries=self.retries, what="GenRM judge request")
            text = engine_reply(body).text
        except Exception as exc:
            with self._lock:
                self._request_failures += 1
                self.totals["request_failures"] += 1
            raise GenRMRequestError(f"GenRM judge request to {self.router_url} failed: {exc}") from exc
        latency = time.monotonic() - t0
        with self._lock:
            self._latencies.append(latency)
            self.totals["judgments"] += 1
        metadata = _get(sample, "metadata")
        if isinstance(metadata, dict):
            metadata["genrm_verdict"] = text[:VERDICT_KEEP_CHARS]
        try:
            score = self.parser(text)
            if score is None:
                raise GenRMParseError("the parser found no score")
            score = float(score)
            if not math.isfinite(score):
                raise GenRMParseError(f"the parser gave a score that is not finite: {score}")
        except Exception as exc:
            with self._lock:
                self._parse_failures += 1
                self.totals["parse_failures"] += 1
            detail = exc if isinstance(exc, GenRMParseError) else f"{type(exc).__name__}: {exc}"
            raise GenRMParseError(f"GenRM verdict could not be parsed: {detail}") from exc
        return score

    # ------------------------------------------------------------------ metrics
    def take_metrics(self) -> dict[str, float]:
        """The metrics of the judgments since the last call (one rollout step's)."""
        with self._lock:
            latencies, self._latencies = self._latencies, []
            parse, self._parse_failures = self._parse_failures, 0
            request, self._request_failures = self._request_failures, 0
        metrics = {"genrm/judgments": float(len(latencies)), "genrm/parse_failures": float(parse),
                   "genrm/request_failures": float(request)}
        if latencies:
            metrics["genrm/latency_mean"] = sum(latencies) / len(latencies)
            metrics["genrm/latency_max"] = max(latencies)
        return metrics


def _get(sample: Any, name: str) -> Any:
    return sample.get(name) if isinstance(sample, dict) else getattr(sample, name, None)


# The rollout manager's judge: reward runners made elsewhere in its process (an evaluation set's) find it here.
_ACTIVE: Optional[GenRMJudge] = None


def set_active_judge(judge: Optional[GenRMJudge]) -> None:
    global _ACTIVE
    _ACTIVE = judge


def active_judge() -> Optional[GenRMJudge]:
    return _ACTIVE
