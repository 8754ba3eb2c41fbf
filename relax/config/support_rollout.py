"""Rollout-side flags whose features are built (see relax.config.support). Add a dest only with its
code and test."""

ROLLOUT_FEATURES: frozenset[str] = frozenset()
