"""Stable path of the built-in dynamic-sampling filters (see relax.engine)."""
