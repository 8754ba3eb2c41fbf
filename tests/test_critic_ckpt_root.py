"""--critic-save writes the critic's checkpoints like the actor's: staged, renamed into place, marker last,
rotated with --max-actor-ckpt-to-keep; a save that dies midway leaves the previous one loadable.
(The PPO e2e test in tests/test_training_e2e_ppo.py saves and reloads a real critic group this way.)"""

from pathlib import Path
from types import SimpleNamespace

import pytest

from relax.core.checkpointing import MARKER, latest_iteration
from relax.core.roles import save_to_own_root


class FilesGroup:
    """Writes what a critic rank group writes (meta.json last); `fail_after` simulates a crash mid-save."""

    def __init__(self, fail_after=None):
        self.fail_after = fail_after

    def save(self, path):
        p = Path(path)
        p.mkdir(parents=True)
        (p / "model_rank0.pt").write_text("weights")
        if self.fail_after == "weights":
            raise RuntimeError("killed while saving")
        (p / "meta.json").write_text("{}")


def test_critic_root_is_staged_marked_and_rotated(tmp_path):
    root = tmp_path / "critic"
    config = SimpleNamespace(max_actor_ckpt_to_keep=2, rotate_ckpt=False)
    for it in (1, 2, 3):
        save_to_own_root(FilesGroup(), root, f"iter_{it:07d}", config)
    assert latest_iteration(root) == 3 and (root / MARKER).read_text() == "3"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["iter_0000002", "iter_0000003"]
    with pytest.raises(RuntimeError, match="killed"):
        save_to_own_root(FilesGroup(fail_after="weights"), root, "iter_0000004", config)
    assert latest_iteration(root) == 3 and (root / "iter_0000003" / "critic" / "meta.json").is_file()
    assert not (root / "iter_0000004").exists()  # the partial save stayed in staging
    save_to_own_root(FilesGroup(), root, "iter_0000004", config)  # the next save cleans the leftover up
    assert latest_iteration(root) == 4 and not any(p.name.startswith(".tmp_") for p in root.iterdir())
