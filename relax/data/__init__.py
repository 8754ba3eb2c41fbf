"""Rollout -> training data: the ``Sample`` record and the TransferQueue-backed ``DataPlane``.

``DataPlane`` is imported lazily so that ``relax.data.Sample`` does not pull in Ray and
TransferQueue.
"""

from relax.data.sample import (
    SAMPLE_FIELDS,
    SAMPLE_STATUSES,
    Sample,
    columns_to_samples,
    samples_to_columns,
)

__all__ = ["SAMPLE_FIELDS", "SAMPLE_STATUSES", "Sample", "columns_to_samples", "samples_to_columns", "DataPlane"]


def __getattr__(name):
    if name == "DataPlane":
        from relax.data.plane import DataPlane

        return DataPlane
    raise AttributeError(f"module 'relax.data' has no attribute {name!r}")
