"""The autoscaler's YAML (--autoscaler-config): schema, defaults and validation, before Ray starts.

    enabled: true
    min_engines: 1                 # never fewer active engines
    max_engines: 32                # never more
    scale_out_cooldown_secs: 60    # after a scale-out, no other scale-out for this long
    scale_in_cooldown_secs: 300    # after any scaling, no scale-in for this long
    metrics_interval_secs: 10      # how often each engine's /metrics is read
    evaluation_interval_secs: 30   # how often a decision is taken
    condition_window_secs: 60      # the metrics kept for decisions (at least each policy's condition duration)
    scale_out_policy:              # any one condition, held for condition_duration_secs, scales out
      token_usage_threshold: 0.85  # mean sglang:token_usage above this
      queue_depth_per_engine: 10   # queued requests per engine above this
      queue_time_p95_threshold: 5.0   # seconds; read when the engines export a queue-time histogram
      ttft_p95_threshold: 10.0        # seconds; likewise time to first token
      condition_duration_secs: 30
      max_delta: 4                 # engines added at most per decision
    scale_in_policy:               # all conditions, held for condition_duration_secs, scale in by one or more
      token_usage_threshold: 0.3   # mean token usage below this
      queue_depth_threshold: 0     # queued requests per engine at most this
      throughput_variance_threshold: 0.1   # coefficient of variation of the generation throughput below this
      condition_duration_secs: 120
      max_delta: 1
      projected_usage_max: 0.5     # token usage the remaining engines would carry must stay below this

A missing key takes the default above; an unknown key, a wrong type or an impossible value fails naming the file and
the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from relax.config.errors import ConfigError


@dataclass(frozen=True)
class ScaleOutPolicy:
    token_usage_threshold: float = 0.85
    queue_depth_per_engine: float = 10
    queue_time_p95_threshold: float = 5.0
    ttft_p95_threshold: float = 10.0
    condition_duration_secs: float = 30
    max_delta: int = 4


@dataclass(frozen=True)
class ScaleInPolicy:
    token_usage_threshold: float = 0.3
    queue_depth_threshold: float = 0
    throughput_variance_threshold: float = 0.1
    condition_duration_secs: float = 120
    max_delta: int = 1
    projected_usage_max: float = 0.5


@dataclass(frozen=True)
class AutoscalerConfig:
    enabled: bool = True
    min_engines: int = 1
    max_engines: int = 32
    scale_out_cooldown_secs: float = 60
    scale_in_cooldown_secs: float = 300
    metrics_interval_secs: float = 10
    evaluation_interval_secs: float = 30
    condition_window_secs: float = 60
    scale_out_policy: ScaleOutPolicy = field(default_factory=ScaleOutPolicy)
    scale_in_policy: ScaleInPolicy = field(default_factory=ScaleInPolicy)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["scale_out_policy"] = {f.name: getattr(self.scale_out_policy, f.name) for f in fields(ScaleOutPolicy)}
        out["scale_in_policy"] = {f.name: getattr(self.scale_in_policy, f.name) for f in fields(ScaleInPolicy)}
        return out


def _section(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{where}.{key}: unknown key; expected one of {', '.join(sorted(known))}")
        kind = known[key].type
        if kind in ("ScaleOutPolicy", "ScaleInPolicy"):
            values[key] = _section(ScaleOutPolicy if kind == "ScaleOutPolicy" else ScaleInPolicy, value,
                                   f"{where}.{key}")
            continue
        if kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}.{key}: expected true or false, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or (kind == "int" and value != int(value)):
            raise ConfigError(f"{where}.{key}: expected {'an integer' if kind == 'int' else 'a number'}, "
                              f"got {value!r}")
        elif value < 0:
            raise ConfigError(f"{where}.{key}: must not be negative, got {value!r}")
        values[key] = int(value) if kind == "int" else value
    return cls(**values)


def load_autoscaler_config(path: str) -> AutoscalerConfig:
    """The validated config of `path` (errors name the file and the key)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--autoscaler-config {path}: no such file")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--autoscaler-config {path}: not valid YAML: {exc}") from None
    cfg = _section(AutoscalerConfig, data, str(path))
    if cfg.min_engines < 1:
        raise ConfigError(f"{path}.min_engines: at least 1 engine must stay, got {cfg.min_engines}")
    if cfg.max_engines < cfg.min_engines:
        raise ConfigError(f"{path}.max_engines ({cfg.max_engines}) is below min_engines ({cfg.min_engines})")
    for name in ("metrics_interval_secs", "evaluation_interval_secs", "condition_window_secs"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{path}.{name}: must be positive")
    for section in ("scale_out_policy", "scale_in_policy"):
        policy = getattr(cfg, section)
        if policy.max_delta < 1:
            raise ConfigError(f"{path}.{section}.max_delta: at least 1, got {policy.max_delta}")
    return cfg
