"""Stable path of the default data source (`--data-source-path`); see relax.rollout.buffer."""

from relax.rollout.buffer import RolloutDataSourceWithBuffer, pop_first

__all__ = ["RolloutDataSourceWithBuffer", "pop_first"]
