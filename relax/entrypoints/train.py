"""`relax-train` / `python -m relax.entrypoints.train`: parse, validate, then run the controller."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from relax.config import ConfigError, parse_config
    from relax.config.explain import explain
    from relax.config.support import no_effect_flags, no_effect_warning, require_supported
    from relax.config.support_gpu import require_gpu_for

    try:
        config = parse_config(argv)
        if config.dry_run:
            print(explain(config))
            return 0
        require_supported(config)
        require_gpu_for(config)
        ignored = no_effect_flags(config)
        if ignored:
            print(f"relax-train: warning: {no_effect_warning(ignored)}", file=sys.stderr)
    except ConfigError as exc:
        print(f"relax-train: error: {exc}", file=sys.stderr)
        return 2
    from relax.core.controller import run_controller

    return run_controller(config)


if __name__ == "__main__":
    sys.exit(main())
