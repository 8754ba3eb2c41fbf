"""`relax-train` / `python -m relax.entrypoints.train`: parse, validate, then run the controller.

`relax-train --version` prints `relax <version>` (the installed package's metadata) and exits before anything
heavy is imported. A run starts with one banner line: version, sync or fully-async, the model, the rollout
engines and the output folder (`banner`).

Around the controller's run: `--notify-urls` messages (started before, finished or failed after, from its exit
code; a failure's message is the first ERROR line the run logged), the `--use-clearml` target check, which
has to happen before Ray starts, and the secrets of the command line masked in `sys.argv` once it is parsed.

The console shows Relax's lines only (`relax.observability.console`): Python warnings are held from the first
line of `main` (Megatron warns while `relax.config` imports it) and written to the run's log file once it is
known; Ray's and the workers' output is routed there too, around the whole run.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from relax.observability.console import HeldWarnings, hold_warnings, route


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("relax")
    except metadata.PackageNotFoundError:  # a source tree that is not installed
        from relax import __version__

        return __version__


def banner(config) -> str:
    """The run's first console line, one fact per field: version, mode, model, rollout engines, output folder."""
    mode = f"fully-async (max staleness {config.max_staleness})" if config.fully_async else "sync"
    model = f"embedded tiny model ({config.hf_checkpoint})" if config.meta.get("embedded_default") \
        else config.hf_checkpoint
    n = config.num_engines
    where = "external" if config.rollout_external else config.rollout_backend
    return (f"relax {version()} | {mode} | model: {model} | rollout: {n} engine{'s' if n != 1 else ''} ({where}) | "
            f"output: {config.output_dir}")


def main(argv: list[str] | None = None) -> int:
    if "--version" in (sys.argv[1:] if argv is None else argv):
        print(f"relax {version()}")
        return 0
    held = hold_warnings()
    try:
        return _main(argv, held)
    finally:
        held.restore()  # a dry run or a config error drops them: there is no log file to write them to


def _main(argv: list[str] | None, held: HeldWarnings) -> int:
    # Imported here, not at the top: relax.config imports Megatron, whose warnings `hold_warnings` has to catch.
    from relax.config.env import apply_driver_env

    apply_driver_env()  # before TransferQueue is imported (relax.config.env.DRIVER_ENV)
    from relax.config import ConfigError, parse_config
    from relax.config.explain import explain
    from relax.config.redact import redact_command
    from relax.config.support import no_effect_flags, no_effect_warning, require_supported, resource_warnings
    from relax.config.support_gpu import require_gpu_for
    from relax.observability.notify import Notifier

    try:
        config = parse_config(argv)
        if config.dry_run:
            print(explain(config))
            return 0
        require_supported(config)
        require_gpu_for(config)
        if config.use_clearml:
            # clearml is imported only when asked for: ~1 s of CPU at every start otherwise
            from relax.observability.clearml_sink import require_clearml_target

            require_clearml_target(config)
        notifier = Notifier.from_config(config)  # an URL Apprise cannot parse is a config error
        ignored = no_effect_flags(config)
        if ignored:
            print(f"relax-train: warning: {no_effect_warning(ignored)}", file=sys.stderr)
        for line in resource_warnings(config):
            print(f"relax-train: warning: {line}", file=sys.stderr)
    except ConfigError as exc:
        print(f"relax-train: error: {exc}", file=sys.stderr)
        return 2
    # The config is parsed: from here on the process's own argv names secrets nowhere. ClearML records the
    # command line of a `python -m` run, Ray the driver's; both read sys.argv.
    sys.argv[:] = redact_command(sys.argv)
    out = Path(config.output_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)  # owner-only, as run_controller keeps it
    # Routed before the controller's imports: TransferQueue gives its loggers a console handler of their own
    # when the root logger has none at import time.
    with route(out / "logs" / "relax.log", held) as output:
        logging.getLogger("relax").info("%s", banner(config))
        from relax.core.run import run_controller
        from relax.observability.ray_console import route_ray_output

        with route_ray_output(output):
            return _run(config, notifier, run_controller)


def _run(config, notifier, run_controller) -> int:
    from relax.observability.notify import FirstError, last_step_summary

    first_error = FirstError()
    relax_log = logging.getLogger("relax")
    relax_log.addHandler(first_error)
    notifier.started(f"{config.num_rollout} rollout steps")
    try:
        code = run_controller(config)
    except BaseException as exc:  # the controller returns codes; anything escaping it still ends the run
        notifier.failed(1, first_error.line or f"{type(exc).__name__}: {exc}")
        raise
    finally:
        relax_log.removeHandler(first_error)
    if code == 0:
        notifier.finished(last_step_summary(Path(config.output_dir) / "metrics.jsonl"))
    else:
        notifier.failed(code, first_error.line)
    return code


if __name__ == "__main__":
    sys.exit(main())
