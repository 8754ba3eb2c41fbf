"""Which flags the running system really honours.

A flag that is parsed but does nothing would lie to the user. Every flag is accepted by the parser,
but a real run refuses to start (before Ray) when a flag outside `IMPLEMENTED` is set to a
non-default value; `--dry-run` lists such flags. Add a dest here only together with the code and
the test that make it work.
"""

from __future__ import annotations

from relax.config.config import Config

# Run control and configuration layer.
_CONFIG_LAYER = {"custom_config_path", "dry_run", "output_dir"}

IMPLEMENTED: frozenset[str] = frozenset(_CONFIG_LAYER)


def unsupported_flags(config: Config, implemented: frozenset[str] = IMPLEMENTED) -> list[str]:
    """Flags the user set to a non-default value whose feature is not built yet (as --flag names)."""
    defaults = config.meta.get("defaults", {})
    names = config.meta.get("flag_names", {})
    out = []
    for dest in sorted(config.explicit):
        if dest in implemented:
            continue
        if dest in defaults and config[dest] == defaults[dest]:
            continue
        out.append(names.get(dest, "--" + dest.replace("_", "-")))
    return out


def require_supported(config: Config) -> None:
    from relax.config.errors import ConfigError

    missing = unsupported_flags(config)
    if missing:
        raise ConfigError("not supported yet: " + ", ".join(missing)
                          + " (these flags are accepted but their features are not built; "
                            "remove them, or see `relax-train --dry-run` for the full list)")
