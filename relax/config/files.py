"""`--custom-config-path` files: YAML or TOML whose keys are flag names.

Files are merged left to right, the command line wins, and everything is merged BEFORE validation
so no file can bypass a check. Values may use OmegaConf interpolation (`${rollout_batch_size}`)
and the resolvers `mul`, `add`, `sub`, `div` (float), `idiv` (integer division), `max`, `min`.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from pathlib import Path
from typing import Any

import yaml

from relax.config.errors import ConfigError

_RESOLVERS = {
    "mul": lambda *xs: _reduce(lambda a, b: a * b, xs),
    "add": lambda *xs: _reduce(lambda a, b: a + b, xs),
    "sub": lambda a, b: a - b,
    "div": lambda a, b: a / b,
    "idiv": lambda a, b: a // b,
    "max": lambda *xs: max(xs),
    "min": lambda *xs: min(xs),
}


def _reduce(fn, xs):
    out = xs[0]
    for x in xs[1:]:
        out = fn(out, x)
    return out


def register_resolvers() -> None:
    from omegaconf import OmegaConf  # only when a file interpolates: importing omegaconf takes ~1 s

    for name, fn in _RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def read_config_file(path: str) -> dict[str, Any]:
    """Raw key -> value mapping of one YAML or TOML file (no interpolation yet)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--custom-config-path: file not found: {path}")
    text = file.read_text()
    try:
        if file.suffix.lower() == ".toml":
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except Exception as exc:  # parse errors of either format
        raise ConfigError(f"--custom-config-path: cannot parse {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--custom-config-path: {path} must hold a mapping of flag names to values")
    return data


def normalise_key(key: Any) -> str:
    return str(key).strip().lstrip("-").replace("-", "_")


def coerce_file_value(action: argparse.Action, value: Any, where: str) -> Any:
    """Give a file value the type its flag has on the command line."""
    flag = action.option_strings[0] if action.option_strings else action.dest
    if isinstance(value, str) and "${" in value:
        return value  # resolved later, then coerced again
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        if value is None or isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: {flag} is a switch; use true or false, not {value!r}")
    if value is None:
        return None
    if type(value) is not bool and value == action.default and type(action.default) is not bool:
        return action.default  # the default itself, with its exact type (e.g. 0 vs 0.0, scalar vs list)
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    if isinstance(action, argparse._AppendAction):
        many = True
    convert = action.type or (lambda v: v)
    try:
        if many:
            items = value if isinstance(value, list) else [value]
            out = [convert(v) if isinstance(v, str) or action.type in (int, float) else v for v in items]
        elif isinstance(value, (dict, list)) and action.type is not None:
            out = value if getattr(action.type, "__name__", "") in ("json_object", "json_value", "layer_pattern") \
                else convert(value)
        elif isinstance(value, str) or action.type in (int, float):
            out = convert(value)
            if action.type is int and isinstance(value, float) and value != int(value):
                raise ValueError(f"{value} is not an integer")
        else:
            out = value
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"{where}: bad value {value!r} for {flag}: {exc}") from None
    if action.choices is not None:
        for item in out if many and isinstance(out, list) else [out]:
            if item not in action.choices:
                raise ConfigError(f"{where}: {flag} must be one of {list(action.choices)}, got {item!r}")
    return out


def load_config_files(paths: list[str], actions: dict[str, argparse.Action]) -> tuple[dict[str, Any], dict[str, str]]:
    """Merge files left to right; returns (dest -> value, dest -> file it came from).

    `--sglang-*` keys that no table types are kept as given (checked when an engine launches).
    """
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for path in paths:
        for raw_key, value in read_config_file(path).items():
            dest = normalise_key(raw_key)
            where = f"{path}: key {raw_key!r}"
            if dest in ("custom_config_path",):
                raise ConfigError(f"{where}: config files cannot include other config files; "
                                  "pass several --custom-config-path flags instead")
            action = actions.get(dest)
            if action is None:
                if dest.startswith("sglang_"):
                    merged[dest] = value
                    origin[dest] = path
                    continue
                close = difflib.get_close_matches(dest, list(actions), n=1, cutoff=0.6)
                hint = f"; did you mean {actions[close[0]].option_strings[0]} ({close[0]})?" if close else ""
                raise ConfigError(f"{where}: unknown flag{hint}")
            merged[dest] = coerce_file_value(action, value, where)
            origin[dest] = path
    return merged, origin


def resolve_interpolations(values: dict[str, Any], actions: dict[str, argparse.Action],
                           origin: dict[str, str]) -> dict[str, Any]:
    """Resolve `${...}` in file values against the merged flag values (command line included)."""
    pending = [k for k, v in values.items() if isinstance(v, str) and "${" in v]
    if not pending:
        return values
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register_resolvers()
    plain = {k: v for k, v in values.items() if _omegaconf_safe(v)}
    try:
        container = OmegaConf.create(plain)
        resolved = {k: container[k] for k in pending}
    except OmegaConfBaseException as exc:
        key = pending[0]
        raise ConfigError(f"{origin.get(key, 'config file')}: cannot resolve interpolation: {exc}".split("\n")[0]) from None
    out = dict(values)
    for key in pending:
        value = resolved[key]
        if hasattr(value, "_content") or OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        action = actions.get(key)
        where = f"{origin.get(key, 'config file')}: key {key!r}"
        out[key] = coerce_file_value(action, value, where) if action is not None else value
    return out


def _omegaconf_safe(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_omegaconf_safe(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _omegaconf_safe(v) for k, v in value.items())
    return False
