"""Assets of the embedded default: a locally built tiny model (format warm start) and a synthetic task.

Building them (random init, ~40 warm-start steps, the task file) costs seconds of CPU on every launch, so
they are built once per key and kept in a user cache folder, ``$RELAX_EMBEDDED_CACHE`` or
``${XDG_CACHE_HOME:-~/.cache}/relax/embedded/<key>/`` (``RELAX_EMBEDDED_CACHE=off`` disables it). The key
hashes everything that decides the bytes: the spec (task, prompts, warm-start steps, seed), the model shape,
the source of the builder modules (a code change invalidates the cache by itself) and the torch and
transformers versions. A run copies the cached files into ``<output-dir>/embedded/`` so that every run
folder stays self-contained (a few hundred KB).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Iterator

from relax.models.tasks import generate_task_dataset
from relax.models.tiny import TinyArch, build_tiny_model_dir
from relax.models.warmstart import format_warm_start

logger = logging.getLogger(__name__)
details = logging.getLogger("relax.details")  # the log file only (relax.observability.console.DETAILS)

EMBEDDED_TASK = "successor"
EMBEDDED_NUM_PROMPTS = 100
WARM_START_STEPS = 40
# "head": only the output head learns the answer format, so the body keeps the prompt in its features and
# GRPO only has to pick the right digit per prompt. On relax-train (benchmarks/seed_sweep.py, 100 steps, with
# the preset's entropy bonus) 8 seeds passed 0.8 at steps 20-26; the whole-model ("all") warm start erased
# the prompt dependence and crossed at 28-98 (seed 5555 stuck at ~0.75). It needs a learning-rate warm-up:
# at lr 1e-3 from the first step a single update collapsed it (entropy 0.006 at step 1 of
# tests/test_estimators_learn.py before that test got 4 warm-up iterations); the preset warms up over 20.
WARM_START_TRAINABLE = "head"
EMBEDDED_ARCH = TinyArch(family="qwen2")
CACHE_ENV = "RELAX_EMBEDDED_CACHE"
_BUILDER_MODULES = ("embedded.py", "tiny.py", "warmstart.py", "tasks.py")
_DATA_NAME = "train.jsonl"
_DONE = "relax_cache_complete.json"


def embedded_spec(seed: int) -> dict:
    return {"task": EMBEDDED_TASK, "num_prompts": EMBEDDED_NUM_PROMPTS, "warm_start_steps": WARM_START_STEPS,
            "warm_start_trainable": WARM_START_TRAINABLE, "seed": seed}


def cache_root() -> Path | None:
    """The cache folder, or None when ``RELAX_EMBEDDED_CACHE=off``."""
    value = os.environ.get(CACHE_ENV, "")
    if value.lower() in ("off", "0", "none", "false"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "relax" / "embedded"


def cache_key(seed: int) -> str:
    """Hash of what builds the assets: spec, model shape, builder source code, torch/transformers versions.

    The versions come from the installed distributions' metadata: importing torch here would put seconds of
    CPU on the launch's serial path before Ray starts (the controller imports it on a thread meanwhile)."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    h.update(json.dumps({"spec": embedded_spec(seed), "arch": dataclasses.asdict(EMBEDDED_ARCH),
                         "torch": metadata.version("torch"), "transformers": metadata.version("transformers")},
                        sort_keys=True).encode())
    for name in _BUILDER_MODULES:
        h.update(name.encode())
        h.update((here / name).read_bytes())
    return h.hexdigest()[:20]


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Without transformers' progress bars ("Writing model shards", "Loading weights"): a build prints no
    library output on relax-train's console."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _build(model_dir: Path, data_path: Path, seed: int) -> dict:
    logger.info("embedded default: building the tiny model (%d warm-start steps) and its task data", WARM_START_STEPS)
    with _quiet_transformers():
        build_tiny_model_dir(model_dir, EMBEDDED_ARCH, seed=seed)
        report = format_warm_start(model_dir, task=EMBEDDED_TASK, steps=WARM_START_STEPS, seed=seed,
                                   trainable=WARM_START_TRAINABLE)
    generate_task_dataset(data_path, EMBEDDED_NUM_PROMPTS, seed, task=EMBEDDED_TASK)
    return report


def _cached_entry(seed: int) -> tuple[Path | None, str]:
    """(complete cache folder for `seed`, "hit" | "miss" | "off" | "error"), building it on a miss."""
    root = cache_root()
    if root is None:
        return None, "off"
    entry = root / cache_key(seed)
    if (entry / _DONE).is_file():
        return entry, "hit"
    try:
        root.mkdir(parents=True, exist_ok=True)
        # Built in a private folder and renamed into place: parallel runs of one seed (benchmarks/seed_sweep.py)
        # never see a half-written entry; the loser of the rename race discards its copy.
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        report = _build(tmp / "model", tmp / _DATA_NAME, seed)
        (tmp / _DONE).write_text(json.dumps({**embedded_spec(seed), "warm_start": report}))
        try:
            os.rename(tmp, entry)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (entry / _DONE).is_file():
                raise
        return entry, "miss"
    except OSError as exc:  # e.g. a read-only home: build in the run folder instead
        logger.warning("embedded default: cache %s not usable (%s); building in the run folder", root, exc)
        return None, "error"


def build_embedded_assets(model_dir: str, data_path: str, seed: int = 0) -> dict:
    """Create (or reuse) the tiny model and the task data; returns what was built.

    `reused`: the run folder already held these assets (a resumed run); `cache`: hit (copied from the user
    cache), miss (built into the cache, then copied), off / error (built in the run folder)."""
    model_dir_p, data_p = Path(model_dir), Path(data_path)
    marker = model_dir_p / "relax_embedded.json"
    spec = embedded_spec(seed)
    if marker.is_file() and json.loads(marker.read_text()) == spec and data_p.is_file():
        logger.info("embedded default: tiny model in %s and task data in %s, kept from the earlier run", model_dir,
                    data_path)
        return {"reused": True, **spec}
    entry, cache = _cached_entry(seed)
    if entry is not None:
        if model_dir_p.exists():
            shutil.rmtree(model_dir_p)
        shutil.copytree(entry / "model", model_dir_p)
        data_p.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(entry / _DATA_NAME, data_p)
        report = json.loads((entry / _DONE).read_text()).get("warm_start")
    else:
        report = _build(model_dir_p, data_p, seed)
    marker.write_text(json.dumps(spec))
    built = {"hit": "from the cache", "miss": "built and cached"}.get(cache, "built")
    logger.info("embedded default: tiny model in %s (%s), task data in %s", model_dir, built, data_path)
    details.info("embedded default: cache %s%s, warm start %s", cache, f" {entry}" if entry else "", report)
    return {"reused": False, **spec, "cache": cache, "cache_dir": str(entry) if entry else None,
            "warm_start": report}
