"""`--dry-run`: the resolved config as YAML, and the batch arithmetic in plain words."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import yaml

from relax.config.config import Config
from relax.config.facts import NO_REFERENCE, REFERENCE_WHERE
from relax.config.old_policy import old_policy_source
from relax.config.redact import redact_values
from relax.config.support import (IMPLEMENTED, no_effect_dest, no_effect_flags, no_effect_warnings, resource_warnings,
                                  unsupported_flags)
from relax.config.support_megatron import refused_groups
from relax.config.support_gpu import gpu_only_flags

# Not written to the resolved YAML: they describe this invocation, not the run.
_NOT_PERSISTED = {"dry_run", "custom_config_path"}


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def resolved_values(config: Config) -> dict[str, Any]:
    """What the run writes as its configuration: every flag, secrets redacted (`relax.config.redact`)."""
    return redact_values({k: _plain(v) for k, v in sorted(config.items()) if k not in _NOT_PERSISTED})


def write_resolved_config(config: Config, path: str | Path | None = None) -> Path:
    path = Path(path or Path(config.output_dir) / "resolved_config.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(resolved_values(config), sort_keys=True))
    tmp.replace(path)
    return path


def batch_arithmetic(config: Config) -> list[str]:
    c = config
    lines = []
    rbs, n = c.rollout_batch_size, c.n_samples_per_prompt
    samples = c.samples_per_step
    lines.append(f"rollout step: {rbs} prompts x {n} samples per prompt = {samples} samples")
    if c.over_sampling_batch_size and c.over_sampling_batch_size != rbs:
        lines.append(f"  prompts are requested {c.over_sampling_batch_size} at a time (over-sampling); "
                     "filtered groups are replaced until the step is full")
    tp, pp, cp = c.tensor_model_parallel_size, c.pipeline_model_parallel_size, c.context_parallel_size
    world, dp = c.actor_world_size, c.data_parallel_size
    lines.append(f"trainer: {world} workers = tensor {tp} x pipeline {pp} x context {cp} x data-parallel {dp}")
    gbs = c.global_batch_size
    if gbs:
        steps = samples // gbs if samples else 0
        lines.append(f"optimizer: {steps} step(s) per rollout, global batch {gbs} samples")
        if c.use_dynamic_batch_size:
            lines.append(f"  micro-batches packed to at most {c.max_tokens_per_gpu} tokens per worker "
                         f"(log-probs: {c.log_probs_max_tokens_per_gpu})")
        else:
            accum = gbs // (c.micro_batch_size * dp) if c.micro_batch_size * dp else 0
            lines.append(f"  micro batch {c.micro_batch_size} per worker x {dp} data-parallel x "
                         f"{accum} accumulation steps = {gbs}")
        lines.append(f"old-policy log-probs: {old_policy_source(c, max(1, steps)).describe()}")
    if c.reference_placement != NO_REFERENCE:
        lines.append(f"reference log-probs: {REFERENCE_WHERE[c.reference_placement]}")
    per_engine = f"{c.rollout_backend}, each on {c.rollout_num_gpus_per_engine} device(s)"
    kind = "external" if c.rollout_external else per_engine
    lines.append(f"rollout engines: {c.num_engines} ({kind}), behind one router")
    lines.append(f"staleness: rollout may run {c.max_staleness} step(s) ahead of training; data queue holds up "
                 f"to {c.data_queue_samples} samples ({c.num_data_storage_units} storage unit(s))")
    if c.num_rollout:
        lines.append(f"run length: {c.num_rollout} rollout steps"
                     + (f" (from --num-epoch {c.num_epoch})" if c.num_epoch and "num_rollout" not in c.explicit else ""))
    return lines


def explain(config: Config) -> str:
    path = write_resolved_config(config)
    out = [f"relax-train --dry-run: configuration is valid; resolved config written to {path}"]
    if config.meta.get("embedded_default"):
        out.append("embedded default: no --hf-checkpoint/--prompt-data given, so a tiny model and a synthetic "
                   "task are built under <output-dir>/embedded at start-up")
    sources = config.meta.get("sources", {})
    out.append(f"flag sources: Megatron flags from {sources.get('megatron')}, SGLang flags from "
               f"{sources.get('sglang')}")
    out.append("")
    out.extend(batch_arithmetic(config))
    missing = unsupported_flags(config)
    ignored = no_effect_flags(config)
    out.append("")
    sglang = [f for f in ignored if not no_effect_dest(f)]
    if sglang:
        out.append("accepted, " + no_effect_warnings(sglang)[0])
    megatron = [f for f in ignored if no_effect_dest(f)]
    if megatron:
        # Their own section: each flag with what has no effect and what Relax does instead (the run warns the same).
        out.append("accepted, no effect in Relax (a real run warns once for each):")
        out.extend("  " + line for line in no_effect_warnings(megatron))
    out.extend("accepted, " + line for line in resource_warnings(config))
    gpu_only = gpu_only_flags(config)
    if gpu_only:
        out.append("needs a GPU (a run on a machine without one stops before Ray): " + "; ".join(gpu_only))
    if missing:
        # The Megatron ones by group, with why they are not built (relax.config.support_megatron.NOT_BUILT); the
        # summary line stays last.
        names = config.meta.get("flag_names", {})
        for group, (why, dests) in refused_groups(IMPLEMENTED).items():
            flags = {names.get(d, "--" + d.replace("_", "-")) for d in dests}
            mine = [m for m in missing if m.split()[0] in flags]
            if mine:
                out.append(f"not built ({group}): {', '.join(mine)}; {why}")
        out.append("not supported yet (a real run stops before starting Ray): " + ", ".join(missing))
    else:
        out.append("every flag you set is supported")
    return "\n".join(out)
