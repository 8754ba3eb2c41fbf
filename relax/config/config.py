"""The immutable, validated configuration handed to every role."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Iterator, Mapping


class Config(Mapping[str, Any]):
    """Read-only flag values by dest name (`cfg.rollout_batch_size`, `cfg["lr"]`), and the values derived
    from them that are not flags (`cfg.actor_world_size`, `cfg.num_engines`: see `DERIVED_FACTS`).

    Built once by `relax.config.parse_config` after all sources are merged and validated.
    Nothing can write to it afterwards; it pickles for Ray. As a mapping it holds the flags only (what the
    resolved config file records); the derived facts are attributes, computed from those flags again
    whenever a config is built.
    """

    __slots__ = ("_values", "_explicit", "_meta", "_derived")

    def __init__(self, values: Mapping[str, Any], explicit: frozenset[str] = frozenset(),
                 meta: Mapping[str, Any] | None = None, derived: Mapping[str, Any] | None = None):
        object.__setattr__(self, "_values", MappingProxyType(dict(values)))
        object.__setattr__(self, "_explicit", frozenset(explicit))
        object.__setattr__(self, "_meta", MappingProxyType(dict(meta or {})))
        object.__setattr__(self, "_derived", MappingProxyType(dict(derived or {})))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            pass
        try:
            return self._derived[name]
        except KeyError:
            raise AttributeError(f"Config has no flag {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Config is immutable; flags are validated once at start-up")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Config is immutable")

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __reduce__(self):
        return (Config, (dict(self._values), self._explicit, dict(self._meta), dict(self._derived)))

    def __repr__(self) -> str:
        return f"Config({len(self._values)} flags, {len(self._explicit)} set explicitly)"

    @property
    def explicit(self) -> frozenset[str]:
        """Dests the user set (command line or config file)."""
        return self._explicit

    @property
    def derived(self) -> Mapping[str, Any]:
        """The derived facts (`DERIVED_FACTS`) by name."""
        return self._derived

    @property
    def meta(self) -> Mapping[str, Any]:
        """Facts about how the config was built (flag sources, defaults, presets)."""
        return self._meta

    def with_prefix(self, prefix: str) -> dict[str, Any]:
        """Values whose dest starts with `prefix`, with the prefix removed and None values dropped."""
        n = len(prefix)
        return {k[n:]: v for k, v in self._values.items() if k.startswith(prefix) and v is not None}

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)
