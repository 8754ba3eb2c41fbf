"""Stable path of the default rollout function (`--rollout-function-path`); see relax.rollout.sglang_rollout."""

from relax.rollout.sglang_rollout import agenerate_rollout, generate_rollout

__all__ = ["generate_rollout", "agenerate_rollout"]
