"""Secrets never reach what a run writes: the resolved config, logs and dashboards show them redacted.

What counts as a secret: every value of `--train-env-vars` (tokens are usually passed that way), any flag
or key whose name ends in api-key/token/password/secret, the password of a URL (`scheme://user:pw@host`), token-like
query parameters, and everything after the scheme of a notification URL (apprise URLs carry their
credentials in the path: `tgram://BOT_TOKEN/CHAT_ID`).
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"
# Names that END in one of these (so --input-key, --moe-token-dispatcher-type stay readable).
_SECRET_NAME = re.compile(r"(api[_-]?key|(?:^|[_-])token|password|passwd|secret)s?$", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@]+):[^/\s@]+@", re.IGNORECASE)
_QUERY_SECRET = re.compile(r"([?&](?:api[_-]?key|key|token|access_token|password|secret|sig)=)[^&\s]+",
                           re.IGNORECASE)
_WHOLE_VALUE_DESTS = frozenset({"train_env_vars"})
_URL_PATH_DESTS = frozenset({"notify_urls"})


def redact_text(text: str) -> str:
    """A string with URL passwords and token-like query parameters masked."""
    return _QUERY_SECRET.sub(rf"\1{REDACTED}", _URL_PASSWORD.sub(rf"\1:{REDACTED}@", text))


def _redact_url_path(url: Any) -> Any:
    """`scheme://<redacted>`; a string of several URLs (commas or spaces between them) keeps each scheme."""
    if isinstance(url, str) and "://" in url:
        urls = [u for u in re.split(r"[\s,]+", url) if u]
        return ",".join(u.split("://", 1)[0] + "://" + REDACTED if "://" in u else REDACTED for u in urls)
    return url


def redact_value(name: str, value: Any) -> Any:
    """`value` of the flag or key `name`, with its secrets masked (containers are walked)."""
    if value is None:
        return None
    if name in _WHOLE_VALUE_DESTS and isinstance(value, dict):
        return {k: REDACTED for k in value}
    if name in _URL_PATH_DESTS:
        return [_redact_url_path(v) for v in value] if isinstance(value, (list, tuple)) else _redact_url_path(value)
    if _SECRET_NAME.search(name) and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return REDACTED
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_value(str(k), v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(name, v) for v in value)
    return value


def redact_values(values: dict[str, Any]) -> dict[str, Any]:
    return {k: redact_value(k, v) for k, v in values.items()}


def redact_command(cmd: list[str]) -> list[str]:
    """A command line for a log: the value of an `--api-key`-like flag is masked (`--flag VALUE` or
    `--flag=VALUE`), as are those of --train-env-vars and --notify-urls (which keeps each URL's scheme)."""
    out = list(cmd)
    for i, arg in enumerate(out):
        name, eq, value = arg.partition("=")
        dest = name[2:].replace("-", "_")
        if not (name.startswith("--") and (_SECRET_NAME.search(name) or dest in _WHOLE_VALUE_DESTS
                                           or dest in _URL_PATH_DESTS)):
            continue
        if not eq:
            if i + 1 >= len(out):
                continue
            value = out[i + 1]
        masked = _redact_url_path(value) if dest in _URL_PATH_DESTS else REDACTED
        if eq:
            out[i] = f"{name}={masked}"
        else:
            out[i + 1] = masked
    return out
