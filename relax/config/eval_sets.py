"""Evaluation sets: `--eval-prompt-data` / `--eval-config`, checked when the config is validated.

Sets come from `--eval-prompt-data NAME PATH [NAME PATH ...]` or from `--eval-config FILE` (YAML or
JSON, OmegaConf interpolation allowed)::

    eval:                       # optional top-level key
      defaults:                 # apply to every dataset (override the --eval-* flags)
        n_samples_per_eval_prompt: 4
        temperature: 0.6
      datasets:
        - name: aime
          path: /data/aime.jsonl
          rm_type: math
          max_response_len: 1024

Per-set keys (anything else is an error naming the file and key): see `EVAL_SET_KEYS`. Unset keys
fall back to the `--eval-*` flags (which fall back to the `--rollout-*` ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from relax.config.errors import ConfigError
from relax.config.files import register_resolvers

# key -> flag dest it overrides (None: a set-only key)
EVAL_SET_KEYS = {
    "name": None, "path": None,
    "input_key": "eval_input_key", "label_key": "eval_label_key", "tool_key": "eval_tool_key",
    "metadata_key": "metadata_key", "rm_type": "rm_type", "custom_rm_path": "custom_rm_path",
    "reward_key": "eval_reward_key", "n_samples_per_eval_prompt": "n_samples_per_eval_prompt",
    "temperature": "eval_temperature", "top_p": "eval_top_p", "top_k": "eval_top_k",
    "max_response_len": "eval_max_response_len", "max_prompt_len": "eval_max_prompt_len",
    "min_new_tokens": "eval_min_new_tokens", "max_context_len": "eval_max_context_len",
    "stop": "rollout_stop", "stop_token_ids": "rollout_stop_token_ids",
}


@dataclass(frozen=True)
class EvalSet:
    name: str
    path: str
    input_key: Optional[str] = None
    label_key: Optional[str] = None
    tool_key: Optional[str] = None
    metadata_key: Optional[str] = None
    rm_type: Optional[str] = None
    custom_rm_path: Optional[str] = None
    reward_key: Optional[str] = None
    n_samples_per_eval_prompt: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_len: Optional[int] = None
    max_prompt_len: Optional[int] = None
    min_new_tokens: Optional[int] = None
    max_context_len: Optional[int] = None
    stop: Optional[tuple] = None
    stop_token_ids: Optional[tuple] = None
    extra: dict = field(default_factory=dict)

    def sampling_params(self, skip_special_tokens: bool = False) -> dict:
        params: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                                  "max_new_tokens": self.max_response_len or 256,
                                  "skip_special_tokens": skip_special_tokens}
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.min_new_tokens:
            params["min_new_tokens"] = int(self.min_new_tokens)
        return params


def reader_keys(es: Any) -> dict[str, Any]:
    """The keys an evaluation set's rows are read with (`relax.formats.prompt_files`), for training's reader
    and for the checks before a run alike."""
    return {"input_key": es.input_key or "input", "label_key": es.label_key,
            "metadata_key": es.metadata_key or "metadata", "tool_key": es.tool_key}


def _flag_defaults(values: Any) -> dict:
    """The set keys' values from the flags; the --eval-* fallbacks to --rollout-* and the other keys are
    derived by config validation before any set is read."""
    out = {}
    for key, dest in EVAL_SET_KEYS.items():
        if dest is not None:
            val = values[dest]
            out[key] = tuple(val) if isinstance(val, list) else val
    return out


def _check_set(where: str, entry: Any) -> dict:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: each dataset must be a mapping with name and path")
    unknown = sorted(set(entry) - set(EVAL_SET_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(EVAL_SET_KEYS)}")
    for key in ("name", "path"):
        if not entry.get(key):
            raise ConfigError(f"{where}: missing {key}")
    if not Path(str(entry["path"])).is_file():
        raise ConfigError(f"{where}: eval data file not found: {entry['path']}")
    n = entry.get("n_samples_per_eval_prompt")
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ConfigError(f"{where}: n_samples_per_eval_prompt must be an integer >= 1, got {n!r}")
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in entry.items()}


def load_eval_config(path: str) -> tuple[dict, list[dict]]:
    """(defaults, datasets) from an --eval-config file, checked; errors name the file and key."""
    from omegaconf import OmegaConf  # only with --eval-config: importing omegaconf takes ~1 s

    register_resolvers()  # the same interpolation resolvers as config files

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--eval-config: file not found: {path}")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(p), resolve=True)
    except Exception as exc:
        raise ConfigError(f"--eval-config {path}: cannot read ({type(exc).__name__}: {exc})") from None
    if isinstance(raw, dict) and set(raw) == {"eval"}:
        raw = raw["eval"]
    if not isinstance(raw, dict) or not isinstance(raw.get("datasets"), list) or not raw["datasets"]:
        raise ConfigError(f"--eval-config {path}: expected a mapping with a non-empty 'datasets' list")
    extra = sorted(set(raw) - {"defaults", "datasets"})
    if extra:
        raise ConfigError(f"--eval-config {path}: unknown top-level key(s) {extra}; use defaults and datasets")
    defaults = raw.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"--eval-config {path}: defaults must be a mapping")
    bad = sorted(set(defaults) - set(EVAL_SET_KEYS) | ({"name", "path"} & set(defaults)))
    if bad:
        raise ConfigError(f"--eval-config {path}: defaults: key(s) not allowed {bad}; allowed: "
                          f"{sorted(set(EVAL_SET_KEYS) - {'name', 'path'})}")
    datasets = [_check_set(f"--eval-config {path}: datasets[{i}]", d) for i, d in enumerate(raw["datasets"])]
    names = [d["name"] for d in datasets]
    if len(set(names)) != len(names):
        raise ConfigError(f"--eval-config {path}: dataset names must be unique, got {names}")
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in defaults.items()}, datasets


def eval_sets(values: Any) -> list[EvalSet]:
    """The evaluation sets of a config (or of the values validation has derived), flag fallbacks applied."""
    base = _flag_defaults(values)
    if values["eval_config"]:
        defaults, datasets = load_eval_config(values["eval_config"])
        entries = []
        for d in datasets:
            own = {**defaults, **d}
            if "rm_type" in own and "custom_rm_path" not in own:
                own["custom_rm_path"] = None  # a set's own reward type beats an inherited --custom-rm-path
            entries.append({**base, **own})
    else:
        pairs = list(values["eval_prompt_data"] or [])
        entries = []
        for name, path in zip(pairs[0::2], pairs[1::2]):
            entries.append({**base, **_check_set(f"--eval-prompt-data {name}", {"name": name, "path": path})})
    known = {f.name for f in fields(EvalSet)}
    return [EvalSet(**{k: v for k, v in e.items() if k in known}) for e in entries]
