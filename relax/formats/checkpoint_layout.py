"""Where the Megatron backend's checkpoints live on disk: file names, folders, the marker and the atomic
save protocol. Plain paths and JSON only (no torch), so that the checks before a run starts
(`relax.core.preflight`) read the same format without importing the trainer.

One role's checkpoint folder (written by `relax.backends.megatron.checkpoint`):

    meta.json             iteration, parallel layout, arch, optimizer_saved (written last)
    scheduler.pt          OptimizerParamScheduler state (rank 0)
    rank<R:05d>.pt        per global rank: model shard, optimizer state, RNG

A save root (`--save`, `--critic-save`) holds one folder per saved iteration:

    iter_<rollout_id:07d>/<role>/             actor, reference, critic: a role's checkpoint folder
    iter_<rollout_id:07d>/relax_state.json    rollout position (data source, sample counter)
    latest_checkpointed_iteration.txt         written last: a checkpoint counts once it names it

Crash safety: an iteration is written under `.tmp_iter_<id>/iter_<id>/` and renamed to `iter_<id>` once
complete (`commit_iteration`); the marker is replaced (write + rename) only after that. A run killed at
any point of a save leaves the previous iteration, and the marker that names it, intact;
`remove_leftovers` clears what a killed save left behind.
"""

from __future__ import annotations

import json
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any, Optional

MARKER = "latest_checkpointed_iteration.txt"
META_FILE = "meta.json"
SCHEDULER_FILE = "scheduler.pt"
RUN_STATE_FILE = "relax_state.json"
FORMAT = 1

_ITER_RE = re.compile(r"^iter_(\d{7})$")
_STAGING_PREFIX = ".tmp_iter_"
_REPLACED_PREFIX = ".old_iter_"


# --------------------------------------------------------------------------- one role's folder
def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def is_saved(path: str | Path) -> bool:
    """A role's folder is complete once its meta.json exists (written last)."""
    return (Path(path) / META_FILE).is_file()


def is_relax_checkpoint(path: str | Path) -> bool:
    return is_saved(path) and (Path(path) / rank_file(0)).is_file()


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / META_FILE).read_text())


def write_meta(path: str | Path, meta: dict[str, Any]) -> None:
    (Path(path) / META_FILE).write_text(json.dumps(meta, indent=1, default=str))


# --------------------------------------------------------------------------- a save root
def iter_name(rollout_id: int) -> str:
    return f"iter_{rollout_id:07d}"


def iter_dir(root: str | Path, rollout_id: int) -> Path:
    return Path(root) / iter_name(rollout_id)


def iterations(root: str | Path) -> list[tuple[int, Path]]:
    """(rollout_id, folder) of every `iter_*` folder under `root`, oldest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _ITER_RE.match(p.name)) and p.is_dir())


def latest_iteration(root: str | Path) -> Optional[int]:
    """The iteration the marker names; None without a marker; ValueError when it holds no number."""
    marker = Path(root) / MARKER
    return int(marker.read_text().strip()) if marker.is_file() else None


def write_marker(root: str | Path, rollout_id: int) -> None:
    """Name `rollout_id` as the latest checkpoint: write a temporary file, then rename it over the marker."""
    root = Path(root)
    tmp = root / "latest.tmp"
    tmp.write_text(str(rollout_id))
    tmp.replace(root / MARKER)


def staging_dir(root: str | Path, rollout_id: int) -> Path:
    """Where iteration `rollout_id` is written before `commit_iteration`: `<this>/iter_<id>`."""
    return Path(root) / f"{_STAGING_PREFIX}{rollout_id:07d}" / iter_name(rollout_id)


def commit_iteration(root: str | Path, rollout_id: int) -> Path:
    """The staged iteration is complete: rename it into place (replacing an earlier save of the same
    iteration), then write the marker. Returns the final folder."""
    root = Path(root)
    staged, final = staging_dir(root, rollout_id), iter_dir(root, rollout_id)
    old = root / f"{_REPLACED_PREFIX}{rollout_id:07d}"
    if final.exists():  # the same iteration saved again (e.g. after --start-rollout-id): replace it
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    staged.rename(final)
    shutil.rmtree(staged.parent, ignore_errors=True)
    write_marker(root, rollout_id)
    shutil.rmtree(old, ignore_errors=True)
    return final


def remove_leftovers(root: str | Path) -> None:
    """Staging folders of saves that never completed (a crash mid-save)."""
    for p in Path(root).iterdir():
        if p.name.startswith((_STAGING_PREFIX, _REPLACED_PREFIX)) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def write_run_state(path: str | Path, rollout_id: int, rollout_state: Any) -> None:
    """The rollout position of iteration folder `path` (data source, sample counter)."""
    (Path(path) / RUN_STATE_FILE).write_text(json.dumps({"rollout_id": rollout_id, "rollout": rollout_state}))


def read_run_state(path: str | Path) -> Any:
    return json.loads((Path(path) / RUN_STATE_FILE).read_text())["rollout"]


# --------------------------------------------------------------------------- integrity
def checkpoint_problem(path: str | Path, role: str = "actor") -> Optional[str]:
    """Why iteration folder `path` cannot be resumed from, or None."""
    path = Path(path)
    folder = path / role
    if not is_saved(folder):
        return f"{folder / META_FILE} is missing (an incomplete checkpoint)"
    if not (path / RUN_STATE_FILE).is_file():
        return f"{path / RUN_STATE_FILE} is missing (an incomplete checkpoint)"
    ranks = sorted(folder.glob("rank*.pt"))
    if not ranks:
        return f"{folder} holds no rank*.pt file"
    for file in [*ranks, *folder.glob(SCHEDULER_FILE)]:
        try:  # torch.save files are zip archives whose directory is at the end: a cut file fails here
            with zipfile.ZipFile(file):
                pass
        except (zipfile.BadZipFile, OSError) as exc:
            return f"{file} is damaged or truncated ({exc})"
    return None


def complete_iterations(root: str | Path) -> list[int]:
    return [rollout_id for rollout_id, path in iterations(root) if checkpoint_problem(path) is None]


def resolve_model_checkpoint(path: str | Path, step: Optional[int] = None, role: str = "actor") -> tuple[str, Path]:
    """Where a model's weights are: ("relax", a role's checkpoint folder) or ("hf", HF folder).

    Accepts a role's folder itself, a save root (marker, `iter_XXXXXXX/<role>`; `step` picks an iteration,
    default the latest), one `iter_XXXXXXX` folder, or an HF model folder (`config.json`).
    """
    p = Path(path)
    if is_relax_checkpoint(p):
        return "relax", p
    latest = latest_iteration(p)
    if step is not None or latest is not None:
        it = step if step is not None else latest
        candidate = iter_dir(p, it) / role
        if is_relax_checkpoint(candidate):
            return "relax", candidate
        raise FileNotFoundError(f"{p}: no {role} checkpoint for iteration {it} ({candidate} is missing)")
    if is_relax_checkpoint(p / role):
        return "relax", p / role
    if (p / "config.json").is_file():
        return "hf", p
    raise FileNotFoundError(f"{p} is neither a Relax checkpoint ({META_FILE}), a save root ({MARKER}) nor a "
                            "Hugging Face model folder (config.json)")


# --------------------------------------------------------------------------- choosing and retaining iterations
def missing_iteration_text(root: str | Path, step: int) -> str:
    """Why iteration `step` of save root `root` cannot be loaded, listing the complete iterations there."""
    found = complete_iterations(root)
    have = ", ".join(map(str, found)) if found else "none"
    folder = iter_dir(root, step)
    problem = checkpoint_problem(folder) if folder.is_dir() else f"{folder} does not exist"
    return f"iteration {step} cannot be loaded ({problem}); complete iterations in {root}: {have}"


def select_iteration(root: str | Path, step: Optional[int] = None) -> Optional[int]:
    """The iteration a resume from save root `root` loads: `step` (--ckpt-step) when given, else the one the
    marker names (None when there is no marker). A `step` that is not a complete iteration raises ValueError
    listing the ones that are (Megatron-LM's --ckpt-step also loads that iteration instead of the tracker's)."""
    if step is None:
        return latest_iteration(root)
    if checkpoint_problem(iter_dir(root, step)) is not None:
        raise ValueError(missing_iteration_text(root, step))
    return step


def iterations_to_delete(ids: list[int], keep: Optional[int], retain_interval: Optional[int],
                         latest: Optional[int]) -> list[int]:
    """Which of the saved iterations `ids` a rotation deletes: all but the newest `keep` (1 when only
    `retain_interval` is set, as Megatron-LM keeps only the last checkpoint besides the retained ones), never one
    that is a multiple of `retain_interval` (--save-retain-interval) and never `latest` (the marker's)."""
    if not keep and not retain_interval:
        return []
    newest = sorted(ids)[-(keep or 1):]
    return [i for i in sorted(ids)
            if i not in newest and i != latest and not (retain_interval and i % retain_interval == 0)]
