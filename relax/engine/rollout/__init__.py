"""Stable paths of the default rollout function and data source (see relax.engine)."""
