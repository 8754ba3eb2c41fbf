"""Flags of fully-async mode and its stages (relax/core/stages.py and the async loops) whose features are built (see relax.config.support). Add a dest only with its code and
test, naming both in a comment beside it."""

ASYNC_FEATURES: frozenset[str] = frozenset({
})
