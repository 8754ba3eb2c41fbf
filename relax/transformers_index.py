"""transformers' index of its model modules, kept in a file instead of rebuilt by every process that imports it.

`import transformers` indexes which names each file of its ~450 model folders exports
(`transformers.utils.import_utils.define_import_structure`), for its lazy attributes: it reads and scans the
source of ~2,600 files, ~0.5 s of CPU in every process that imports transformers. A run's start pays it in the
trainer rank, the rollout manager and the embedded engine's server, all at once on the same cores. The index
depends only on the installed files, so it is written once, keyed by transformers' version, the folder and the
names, sizes and modification times of its files (a stat of each, ~40 ms), and read back by later processes
(~5 ms). Any change to the installed files makes a new key; a file that cannot be read or written leaves
transformers to build the index as it always does.

`install()` arms this for the process's first import of transformers, whoever makes it (relax.importing); it
imports nothing itself (the standard library modules it needs are imported when the index is first wanted).
`relax/__init__.py` calls it, so every process that imports Relax has it, beside relax.lazy_jit.
RELAX_TRANSFORMERS_INDEX_CACHE=off leaves transformers alone.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Callable, Iterator

from relax.importing import patch_import

ENV = "RELAX_TRANSFORMERS_INDEX_CACHE"
_MODULE = "transformers.utils.import_utils"


def install() -> None:
    if os.environ.get(ENV, "").lower() in ("off", "0"):
        return
    patch_import(_MODULE, _cache_the_index)


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "relax", "transformers-index")


@contextlib.contextmanager
def _cache_the_index() -> Iterator[None]:
    yield  # transformers' package runs `from .utils.import_utils import define_import_structure` after this
    module = sys.modules.get(_MODULE)
    build = getattr(module, "define_import_structure", None)
    if callable(build):
        module.define_import_structure = cached(build)


def cached(build: Callable[..., dict], directory: str | None = None) -> Callable[..., dict]:
    """`build` (define_import_structure(module_path, prefix=None)) with its result kept under `directory`."""

    @functools.wraps(build)
    def define_import_structure(module_path: Any, prefix: str | None = None) -> dict:
        import json

        try:
            path = os.path.join(directory or cache_dir(), _key(str(module_path), prefix) + ".json")
        except OSError:
            return build(module_path, prefix)
        try:
            with open(path, encoding="utf-8") as f:
                return _decode(json.load(f))
        except (OSError, ValueError, TypeError, AttributeError):  # none yet, or damaged: built again
            pass
        structure = build(module_path, prefix)
        with contextlib.suppress(OSError, TypeError, ValueError):
            _write(path, json.dumps(_encode(structure)))
        return structure

    define_import_structure.kept_in = directory  # marks the wrapper (None: cache_dir() at each call)
    return define_import_structure


def _key(module_path: str, prefix: str | None) -> str:
    """What the index is built from: transformers' version, the folder, and each file's name, size and time."""
    import hashlib

    digest = hashlib.sha256()
    version = getattr(sys.modules.get("transformers"), "__version__", "")
    digest.update(f"{version}\0{os.path.realpath(module_path)}\0{prefix}\0".encode())
    folders = [module_path]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        folders.append(entry.path)
                else:
                    stat = entry.stat()
                    digest.update(f"{entry.path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:32]


def _encode(structure: dict) -> list:
    """{frozenset(backends): {module: set(names)}} as JSON: the outer order kept, sets sorted."""
    return [[sorted(backends), {module: sorted(names) for module, names in modules.items()}]
            for backends, modules in structure.items()]


def _decode(data: list) -> dict:
    return {frozenset(backends): {module: set(names) for module, names in modules.items()}
            for backends, modules in data}


def _write(path: str, text: str) -> None:
    """Whole or not at all: processes starting together may write the same index at once."""
    import tempfile

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".index-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
