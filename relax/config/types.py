"""Value types for flags: byte sizes, JSON values, booleans, dotted paths."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from relax.config.megatron_table import str2bool

__all__ = ["byte_size", "json_value", "str2bool", "json_object"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def byte_size(value: Any) -> int:
    """Bytes as an int; accepts 536870912, '512MB', '512MiB', '1GB' (binary multiples)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise argparse.ArgumentTypeError(f"expected a byte size such as 536870912 or 512MB, got {value!r}")
    number, unit = match.groups()
    unit_key = (unit or "").lower().rstrip("b").rstrip("i")
    if unit_key not in _UNITS:
        raise argparse.ArgumentTypeError(f"unknown size unit in {value!r}")
    return int(float(number) * _UNITS[unit_key])


def json_value(value: Any) -> Any:
    """Parse a JSON string; the error shows the text and where parsing failed."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"invalid JSON {value!r}: {exc.msg} at column {exc.colno}"
        ) from None


def json_object(value: Any) -> dict:
    parsed = json_value(value)
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {value!r}")
    return parsed
