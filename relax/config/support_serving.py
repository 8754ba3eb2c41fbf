"""Flags of serving-side roles: the GenRM and the Relax router (--use-slime-router) whose features are built (see relax.config.support). Add a dest only with its code and
test, naming both in a comment beside it."""

SERVING_FEATURES: frozenset[str] = frozenset({
})
