"""Python's cyclic garbage collector in Relax's processes: the heap built at start-up is frozen.

A Relax process (the driver, a trainer rank, the rollout manager, an engine server, the reference process) holds
a few hundred thousand long-lived objects from its imports (torch, Megatron, transformers, Ray) and its model
build. CPython's collector scans all of them at each full (generation-2) collection: measured on the embedded
default (2 cores, 30 steps): 6-8 full collections of 60-260 ms in each process while it starts (~1.1 s of CPU in
a trainer rank, ~3 s over the run's processes), and then one of 150-250 ms every 3-8 s per process during the
steps, each a step 0.1-0.2 s slower than its neighbours. Nothing in those objects is garbage.

`gc.freeze()` moves every object alive into a permanent generation that collections skip (what CPython's docs
suggest for long-lived heaps); objects are still freed when their last reference goes, and cycles formed later
are collected as before. `install()` (called by relax/__init__.py, standard library only) pauses the collector
while torch, transformers and Megatron import, then freezes what they built; `freeze()` is called again when a
process's set-up is done (its model built), so the steps' collections scan only what the steps allocate."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

from relax.importing import patch_import

# the heavy imports, each paused and frozen on its first import in the process
HEAVY_IMPORTS = ("torch", "transformers", "megatron")


def install() -> None:
    for name in HEAVY_IMPORTS:
        patch_import(name, collector_paused)


def freeze() -> None:
    """When a process's set-up is done: collect what it left as garbage (a short scan once the imports are
    frozen), then move every object alive into the collector's permanent generation."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No collection inside the block (unless it enables the collector itself); its objects are frozen after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
