"""`--multimodal-keys`: which data fields hold images, videos or audio, and how they reach SGLang.

The flag maps a modality to a field of the prompt rows, e.g. ``'{"image": "images"}'``. Each prompt
record then carries ``{"image": row["images"]}`` (a path, URL, base64 data URL, or a list of them;
rows without the field stay text-only), every sample of its group gets it as
``Sample.metadata["multimodal_inputs"]``, and each /generate request for that sample carries it as
SGLang's ``image_data`` / ``video_data`` / ``audio_data`` next to ``input_ids``.

Only engines that take such inputs can serve these runs: the embedded engine is text-only, so a run
with --multimodal-keys and --rollout-backend embedded stops at parse time (and at engine start when
`auto` resolves to embedded). The processor-side flags (--image-max-token-num, fps, audio in video...)
are not built.
"""

from __future__ import annotations

from typing import Any, Optional

from relax.config.errors import ConfigError

MODALITIES = ("image", "video", "audio")
SAMPLE_KEY = "multimodal_inputs"  # Sample.metadata key


def check_multimodal_keys(mapping: Any) -> Optional[dict[str, str]]:
    """The validated mapping modality -> field (None when unset); errors name the flag and the fix."""
    if mapping is None:
        return None
    if not isinstance(mapping, dict) or not mapping:
        raise ConfigError('--multimodal-keys must be a non-empty JSON object, e.g. \'{"image": "images"}\'')
    for modality, key in mapping.items():
        if modality not in MODALITIES:
            raise ConfigError(f"--multimodal-keys: unknown modality {modality!r}; use one of {list(MODALITIES)}")
        if not isinstance(key, str) or not key:
            raise ConfigError(f"--multimodal-keys: the field of {modality!r} must be a non-empty string, "
                              f"got {key!r}")
    return dict(mapping)


def payload_fields(inputs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The /generate request fields for a sample's multimodal inputs: {"image_data": ..., ...}."""
    if not inputs:
        return {}
    return {f"{modality}_data": value for modality, value in inputs.items() if modality in MODALITIES}


def require_engine_support(config: Any, backend: str) -> None:
    """Stop before serving multimodal samples from an engine that would drop the images."""
    if getattr(config, "multimodal_keys", None) and backend == "embedded":
        raise ConfigError("--multimodal-keys needs an engine that takes images/videos/audio (SGLang): the "
                          "embedded engine is text-only; use --rollout-backend sglang or drop --multimodal-keys")
