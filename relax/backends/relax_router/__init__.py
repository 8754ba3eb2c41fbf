"""Relax's own router (`--use-slime-router`): text-aware routing, worker failure thresholds, deadlines and
a middleware chain (`server.py`, `middleware.py`), run as a child process (`process.py`); the radix-tree
token cache for text-based multi-turn agents is `radix_middleware.RadixTreeMiddleware`."""
