"""Run checkpoints: trainer state (model, optimizer, scheduler, RNG) + rollout position, saved atomically.

Layout under --save:  iter_<rollout_id:07d>/actor/...  iter_<...>/relax_state.json
                      latest_checkpointed_iteration.txt   (written last: a checkpoint counts once it exists)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import ray

logger = logging.getLogger("relax")


def save_checkpoint(controller: Any, rollout_id: int) -> Path:
    root = Path(controller.config.save)
    path = root / f"iter_{rollout_id:07d}"
    ray.get([w.save.remote(str(path / "actor")) for w in controller.workers])
    controller.aux.save(str(path))
    state = ray.get(controller.rollout.state_dict.remote())
    tmp = path / "relax_state.json.tmp"
    tmp.write_text(json.dumps({"rollout_id": rollout_id, "rollout": state}))
    tmp.replace(path / "relax_state.json")
    marker = root / "latest_checkpointed_iteration.txt"
    (root / "latest.tmp").write_text(str(rollout_id))
    (root / "latest.tmp").replace(marker)
    return path


def resume_from(controller: Any, load: str) -> None:
    config = controller.config
    root = Path(load)
    marker = root / "latest_checkpointed_iteration.txt"
    if not marker.is_file():
        logger.info("--load %s holds no checkpoint yet; starting from step 0", load)
        return
    rollout_id = int(marker.read_text().strip())
    path = root / f"iter_{rollout_id:07d}"
    ray.get([w.load.remote(str(path / "actor")) for w in controller.workers])
    controller.aux.load(str(path))
    state = json.loads((path / "relax_state.json").read_text())
    ray.get(controller.rollout.load_state_dict.remote(state["rollout"]))
    controller.start_step = rollout_id if config.start_rollout_id is None else config.start_rollout_id
    ray.get([w.push_weights.remote(controller.engine_urls, rollout_id, config.update_weight_buffer_size)
             for w in controller.workers])
    logger.info("resumed from %s at rollout step %d", path, controller.start_step)
