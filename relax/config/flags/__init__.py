"""Relax's own flags, one module per group of the configuration reference."""

from relax.config.flags import (
    algorithm,
    batch,
    checkpoint,
    cluster,
    data,
    evaluation,
    fault,
    lora,
    misc,
    observability,
    reward,
    rollout,
    router,
)

GROUP_MODULES = (cluster, checkpoint, data, rollout, batch, algorithm, lora, evaluation, reward, fault,
                 observability, router, misc)


def add_relax_flags(parser) -> None:
    for module in GROUP_MODULES:
        module.add_flags(parser)
