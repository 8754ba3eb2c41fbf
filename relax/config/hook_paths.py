"""Dotted paths of hooks that moved: the paths the flag reference's defaults and public launch scripts name.

The reference documents `--rollout-function-path`'s and `--data-source-path`'s defaults and the DAPO filter of
`--dynamic-sampling-filter-path` under `relax.engine.*`; the code lives in `relax.rollout`. The hook loader
(relax.config.validate.import_hook) reads a moved module's path as its new one, so those defaults and
scripts keep working without a package of re-exports; a path a user passes explicitly gets one warning
naming the new path.
"""

from __future__ import annotations

# old module -> the module that holds the same names now
MOVED_MODULES: dict[str, str] = {
    "relax.engine.rollout.sglang_rollout": "relax.rollout.sglang_rollout",
    "relax.engine.rollout.data_source": "relax.rollout.buffer",
    "relax.engine.filters.dynamic_sampling_filters": "relax.rollout.filters",
}


def current_module(module_name: str) -> str:
    """The module to import for `module_name` (itself unless it moved)."""
    return MOVED_MODULES.get(module_name, module_name)


def moved_path_warning(path: str, flag_name: str) -> str | None:
    """The warning for an explicitly given hook path whose module moved; None when it did not."""
    module_name, _, attr = path.rpartition(".")
    new = MOVED_MODULES.get(module_name)
    if new is None:
        return None
    return f"{flag_name} {path}: the module moved to {new}; the old path keeps working, {new}.{attr} is the current one"
