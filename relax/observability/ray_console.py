"""Ray's output in the driver of relax-train, routed as `relax.observability.console` says.

Ray's driver prints what the workers write (`log_to_driver`) through `ray._private.worker.print_to_stdstream`,
which `ray.init` binds when it connects: `route_ray_output` puts a `WorkerOutput` in its place before that.
Ray's own logger ("ray": the token-authentication notice, "Started a local Ray instance.") loses its console
handler and passes its records to the root logger, whose console handler shows Relax's records only: they
reach the log file alone. Both are Ray internals (setup.py asks for ray>=2.40, not one version): where one is
missing, the run goes on with that output on the console as before, and the log file says so.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import ray._private.worker as ray_worker

from relax.observability.console import WorkerOutput

logger = logging.getLogger("relax.console")


@contextmanager
def route_ray_output(output: WorkerOutput) -> Iterator[None]:
    """Within: workers' output goes to `output`, Ray's driver-side records to the log file (see above)."""
    ray_logger = logging.getLogger("ray")
    handlers, propagate = list(ray_logger.handlers), ray_logger.propagate
    for handler in handlers:
        ray_logger.removeHandler(handler)
    ray_logger.propagate = True
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None:
        logger.info("ray._private.worker.print_to_stdstream is gone: workers' output stays on the console")
    else:
        ray_worker.print_to_stdstream = output
        output.autoscaler_events = getattr(ray_worker, "filter_autoscaler_events", None)
    try:
        yield
    finally:
        if original is not None:
            ray_worker.print_to_stdstream = original
        for handler in handlers:
            ray_logger.addHandler(handler)
        ray_logger.propagate = propagate
