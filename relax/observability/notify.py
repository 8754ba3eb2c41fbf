"""`--notify-urls`: run started / finished / failed messages through Apprise (https://github.com/caronc/apprise).

The flag takes Apprise URLs separated by commas (or spaces): `tgram://BOT_TOKEN/CHAT_ID`,
`slack://TOKEN_A/TOKEN_B/TOKEN_C`, `json://host:port/path`, ... Each URL carries its credentials, so a URL
never reaches a log, the resolved config or ClearML as written: only its scheme (`tgram://<redacted>`,
`relax.config.redact`). Apprise's own log records (which name hosts and, at debug level, whole URLs) are kept
out of the run's logs; what they say about a failure is passed on with every piece of the URLs masked.

An URL Apprise cannot parse stops the run before it starts (a config error naming the flag). A notification
that cannot be delivered never stops a run: the first failure is a warning, later ones are logged at debug.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import apprise

from relax.config.errors import ConfigError
from relax.config.redact import REDACTED, redact_text

log = logging.getLogger("relax.notify")
SEND_TIMEOUT_S = 30.0  # a notification endpoint that hangs must not hold the run's start or its exit
_SPLIT = re.compile(r"[\s,]+")
_PIECES = re.compile(r"[/:@?&=#]+")
_SUMMARY_KEYS = ("rollout/reward_mean", "rollout/response_len_mean", "train/loss")


def split_urls(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """The URLs of --notify-urls (commas or whitespace between them)."""
    if not value:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [u for item in items for u in _SPLIT.split(str(item)) if u]


def redacted_url(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    return f"{scheme}://{REDACTED}" if sep else REDACTED


class _Scrubber(logging.Filter):
    """Masks every piece of the given URLs (host, user, password, path parts, query values) in a text; as a
    logging filter, in the records of the HTTP client's loggers (urllib3 names the path it posts to)."""

    def __init__(self, urls: list[str] = ()):
        super().__init__()
        self._pieces: list[str] = []
        self.add(urls)

    def add(self, urls: list[str]) -> None:
        pieces = set(self._pieces)
        for url in urls:
            rest = url.partition("://")[2] or url
            pieces.add(rest)
            pieces.update(p for p in _PIECES.split(rest) if len(p) >= 4)
        self._pieces = sorted(pieces, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        text = redact_text(text)
        for piece in self._pieces:
            text = text.replace(piece, REDACTED)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:
            return True
        scrubbed = self(text)
        if scrubbed != text:
            record.msg, record.args = scrubbed, None
        return True


# Loggers of the HTTP stack Apprise posts through; their debug records carry the URL's path.
_HTTP_LOGGERS = ("urllib3.connectionpool", "requests")
_HTTP_SCRUBBER = _Scrubber()


class _Collect(logging.Handler):
    """Apprise's warnings and errors of one call, kept to explain a failure."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _apprise_records() -> Iterator[_Collect]:
    """Apprise's log records go to the returned collector only (not to the run's console and log file)."""
    alog = logging.getLogger(apprise.logger.name if hasattr(apprise, "logger") else "apprise")
    collect = _Collect()
    saved = alog.propagate
    alog.propagate = False
    alog.addHandler(collect)
    try:
        yield collect
    finally:
        alog.removeHandler(collect)
        alog.propagate = saved


def check_urls(urls: list[str]) -> apprise.Apprise:
    """An Apprise object with every URL added; ConfigError naming --notify-urls for one Apprise cannot parse."""
    apobj = apprise.Apprise()
    bad = []
    with _apprise_records():
        for i, url in enumerate(urls, 1):
            if not apobj.add(url):
                bad.append(f"URL {i} ({redacted_url(url)})")
    if bad:
        raise ConfigError(f"--notify-urls: Apprise cannot use {', '.join(bad)}; see "
                          "https://github.com/caronc/apprise/wiki for the URL of each service")
    return apobj


def run_name(config: Any) -> str:
    """How messages (and the ClearML task) name a run: --tb-experiment-name, else the output folder's name."""
    return config.tb_experiment_name or Path(config.output_dir).resolve().name or "run"


class Notifier:
    """Sends the run's lifecycle messages to every URL; without URLs every call does nothing."""

    def __init__(self, urls: list[str], name: str, output_dir: str = ""):
        self.urls = list(urls)
        self.name = name
        self.output_dir = output_dir
        self._apprise = check_urls(self.urls) if self.urls else None
        self._scrub = _Scrubber(self.urls)
        if self.urls:
            _HTTP_SCRUBBER.add(self.urls)
            for name in _HTTP_LOGGERS:
                if _HTTP_SCRUBBER not in logging.getLogger(name).filters:
                    logging.getLogger(name).addFilter(_HTTP_SCRUBBER)
        self._warned = False
        self._t0 = time.monotonic()
        self.host = socket.gethostname()

    @classmethod
    def from_config(cls, config: Any) -> "Notifier":
        return cls(split_urls(config.notify_urls), run_name(config), str(config.output_dir))

    def __bool__(self) -> bool:
        return bool(self.urls)

    def started(self, detail: str = "") -> bool:
        self._t0 = time.monotonic()
        body = f"started on {self.host}; output in {self.output_dir}" + (f"; {detail}" if detail else "")
        return self.send(f"relax run {self.name} started", body, apprise.NotifyType.INFO)

    def finished(self, detail: str = "") -> bool:
        body = f"finished after {_duration(time.monotonic() - self._t0)}; output in {self.output_dir}" + (
            f"; {detail}" if detail else "")
        return self.send(f"relax run {self.name} finished", body, apprise.NotifyType.SUCCESS)

    def restarted(self, detail: str) -> bool:
        """--use-health-check restarted the run after a failure (`detail`: what failed, where it resumes)."""
        return self.send(f"relax run {self.name} restarted", f"restarted on {self.host}: {detail}",
                         apprise.NotifyType.WARNING)

    def failed(self, code: int, error: str | None) -> bool:
        first = (error or "").strip().splitlines()
        reason = first[0] if first else "no error message was logged"
        body = (f"failed (exit {code}) after {_duration(time.monotonic() - self._t0)} on {self.host}: {reason}; "
                f"log: {self.output_dir}/logs/relax.log")
        return self.send(f"relax run {self.name} failed", body, apprise.NotifyType.FAILURE)

    def send(self, title: str, body: str, kind: apprise.NotifyType = apprise.NotifyType.INFO) -> bool:
        """True when every URL took the message. Never raises: a failure is a warning (the first) or debug."""
        if self._apprise is None:
            return False
        title, body = redact_text(title), redact_text(body)
        try:
            with _apprise_records() as collect:
                ok = bool(self._apprise.notify(body=body, title=title, notify_type=kind, timeout=SEND_TIMEOUT_S))
            why = "; ".join(self._scrub(m) for m in collect.messages[-3:])
        except Exception as exc:  # a plugin's bug must not end the run either
            ok, why = False, self._scrub(f"{type(exc).__name__}: {exc}")
        if not ok:
            targets = ", ".join(redacted_url(u) for u in self.urls)
            msg = f"notification {title!r} to {targets} failed" + (f": {why}" if why else "")
            if self._warned:
                log.debug("%s", msg)
            else:
                self._warned = True
                log.warning("%s (further notification failures are logged at debug level only)", msg)
        return ok


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class FirstError(logging.Handler):
    """Keeps the first line of the first ERROR record of a logger (the failure a run reports on its console)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.line: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.line is None:
            try:
                text = record.getMessage().strip()
            except Exception:
                return
            if text:
                self.line = text.splitlines()[0]


def last_step_summary(metrics_path: str | Path) -> str:
    """'last step N: reward_mean=..., response_len_mean=...' from a metrics.jsonl ('' when there is none)."""
    try:
        lines = Path(metrics_path).read_text(encoding="utf-8").splitlines()
        record = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return ""
    if not isinstance(record, dict) or "step" not in record:
        return ""
    shown = [f"{k.split('/')[-1]}={record[k]:.4g}" for k in _SUMMARY_KEYS if isinstance(record.get(k), (int, float))]
    return f"last step {record['step']}" + (f": {', '.join(shown)}" if shown else "")
