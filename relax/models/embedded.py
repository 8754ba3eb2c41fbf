"""Assets of the embedded default: a locally built tiny model (format warm start) and a synthetic task."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from relax.models.tasks import generate_task_dataset
from relax.models.tiny import TinyArch, build_tiny_model_dir
from relax.models.warmstart import format_warm_start

logger = logging.getLogger(__name__)

EMBEDDED_TASK = "successor"
EMBEDDED_NUM_PROMPTS = 100
WARM_START_STEPS = 40


def build_embedded_assets(model_dir: str, data_path: str, seed: int = 0) -> dict:
    """Create (or reuse) the tiny model and the task data; returns what was built."""
    model_dir_p, data_p = Path(model_dir), Path(data_path)
    marker = model_dir_p / "relax_embedded.json"
    spec = {"task": EMBEDDED_TASK, "num_prompts": EMBEDDED_NUM_PROMPTS, "warm_start_steps": WARM_START_STEPS,
            "seed": seed}
    if marker.is_file() and json.loads(marker.read_text()) == spec and data_p.is_file():
        return {"reused": True, **spec}
    build_tiny_model_dir(model_dir_p, TinyArch(family="qwen2"), seed=seed)
    report = format_warm_start(model_dir_p, task=EMBEDDED_TASK, steps=WARM_START_STEPS, seed=seed)
    generate_task_dataset(data_p, EMBEDDED_NUM_PROMPTS, seed, task=EMBEDDED_TASK)
    marker.write_text(json.dumps(spec))
    logger.info("embedded default: tiny model in %s (warm start %s), task data in %s", model_dir, report, data_path)
    return {"reused": False, **spec, "warm_start": report}
