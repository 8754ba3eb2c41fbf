"""Training-side flags whose features are built (see relax.config.support). Add a dest only with its
code and test."""

TRAINING_FEATURES: frozenset[str] = frozenset()
