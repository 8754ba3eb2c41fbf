"""`--multimodal-keys`: which data fields hold images, videos or audio, and how they reach SGLang.

The flag maps a modality to a field of the prompt rows, e.g. ``'{"image": "images"}'``. Each prompt
record then carries ``{"image": row["images"]}`` (a path, URL, base64 data URL, or a list of them;
rows without the field stay text-only), every sample of its group gets it as
``Sample.metadata["multimodal_inputs"]``, and each /generate request for that sample carries it as
SGLang's ``image_data`` / ``video_data`` / ``audio_data`` next to ``input_ids``.

Only engines that take such inputs can serve these runs: the embedded engine is text-only, so config
validation stops a run with --multimodal-keys whose --rollout-backend is (or `auto` resolves to) embedded
(`relax.config.rules_rollout`, where the flag's mapping is checked too). The processor-side flags
(--image-max-token-num, fps, audio in video...) are not built. A value SGLang cannot take (a number, raw bytes,
an empty list) is refused by `relax.formats.row_checks.multimodal_problem`, here for each request and, for every row
of the prompt files, by the preflight before Ray starts.
"""

from __future__ import annotations

from typing import Any, Optional

from relax.config.rules_rollout import MODALITIES
from relax.formats.row_checks import multimodal_problem

SAMPLE_KEY = "multimodal_inputs"  # Sample.metadata key


def payload_fields(inputs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The /generate request fields for a sample's multimodal inputs: {"image_data": ..., ...}."""
    if not inputs:
        return {}
    fields = {}
    for modality, value in inputs.items():
        if modality in MODALITIES:
            problem = multimodal_problem(modality, value)
            if problem:
                raise ValueError(str(problem))
            fields[f"{modality}_data"] = value
    return fields
