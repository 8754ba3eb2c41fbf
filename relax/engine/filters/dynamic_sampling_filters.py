"""Stable path of the built-in dynamic-sampling filters (`--dynamic-sampling-filter-path`); see
relax.rollout.filters."""

from relax.rollout.filters import check_reward_nonzero_std

__all__ = ["check_reward_nonzero_std"]
