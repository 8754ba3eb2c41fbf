"""Which flags the running system really honours.

A flag that is parsed but does nothing would lie to the user. Every flag is accepted by the parser,
but a real run refuses to start (before Ray) when a flag outside `IMPLEMENTED` is set to a
non-default value; `--dry-run` lists such flags. Add a dest here only together with the code and
the test that make it work.
"""

from __future__ import annotations

import enum
import math
from typing import Any

from relax.config.config import Config
from relax.config.errors import ConfigError
from relax.config.megatron_mirror import ROWS as MEGATRON_ROWS
from relax.config.support_async import ASYNC_FEATURES
from relax.config.support_deps import dependency_reason
from relax.config.support_health import HEALTH_FEATURES
from relax.config.support_megatron import MEGATRON_FEATURES, NO_EFFECT_REASONS, no_effect_lines
from relax.config.support_ops import OPS_FEATURES
from relax.config.support_rollout import ROLLOUT_FEATURES
from relax.config.support_serving import SERVING_FEATURES
from relax.config.support_training import TRAINING_FEATURES, TRAINING_SUPPORTED_VALUES
from relax.config.support_weights import WEIGHTS_FEATURES

# Run control and configuration layer.
_CONFIG_LAYER = {"custom_config_path", "dry_run", "output_dir"}

# Post-hoc analysis dumps (relax/observability/train_dump.py; tests/test_dump_details.py).
_DUMPS = {"dump_details", "save_debug_train_data"}

# The synchronous end-to-end loop (controller, trainer group, rollout manager, data plane).
_E2E_LOOP = {
    # cluster, data plane, placement
    "resource", "num_data_storage_units", "polling_mode", "rollout_num_gpus_per_engine", "rollout_backend",
    "rollout_external", "rollout_external_engine_addrs", "sglang_router_policy", "sglang_router_port",
    "train_env_vars", "distributed_backend", "distributed_timeout_minutes",
    # data and prompts
    "hf_checkpoint", "prompt_data", "input_key", "label_key", "metadata_key", "tool_key", "apply_chat_template",
    "apply_chat_template_kwargs", "system_prompt", "rollout_shuffle", "rollout_seed", "rollout_max_prompt_len",
    "use_streaming_dataset", "streaming_buffer_size", "num_rollout", "num_epoch",
    # sampling
    "rollout_batch_size", "n_samples_per_prompt", "rollout_temperature", "rollout_top_p", "rollout_top_k",
    "rollout_max_response_len", "rollout_max_context_len", "rollout_stop", "rollout_stop_token_ids",
    "rollout_skip_special_tokens",
    # rewards
    "rm_type", "custom_rm_path", "reward_key", "group_rm", "rm_url", "reward_error_policy", "reward_timeout",
    # deadlines of the calls into engines, router, storage units and trainer ranks (relax.core.deadlines)
    "generate_timeout", "weight_update_timeout", "engine_control_timeout", "train_step_timeout",
    # algorithm
    "advantage_estimator", "normalize_advantages", "disable_grpo_std_normalization",
    "disable_rewards_normalization", "eps_clip", "eps_clip_high", "eps_clip_c", "entropy_coef", "sapo_tau_pos",
    "sapo_tau_neg", "use_rollout_logprobs", "loss_type",
    # trainer (Megatron)
    "global_batch_size", "micro_batch_size", "num_steps_per_rollout", "calculate_per_token_loss",
    "log_probs_chunk_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "seed", "lr", "min_lr",
    "lr_decay_style", "lr_warmup_iters", "lr_decay_iters", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
    "clip_grad", "bf16", "fp16", "use_distributed_optimizer",
    # weights, checkpoints, metrics
    "update_weight_buffer_size", "update_weights_interval", "megatron_to_hf_mode", "save", "save_interval", "load",
    "start_rollout_id",
    "use_tensorboard", "tb_project_name", "tb_experiment_name",
}

IMPLEMENTED: frozenset[str] = frozenset(_CONFIG_LAYER | _DUMPS | _E2E_LOOP | TRAINING_FEATURES | ROLLOUT_FEATURES
                                        | WEIGHTS_FEATURES | ASYNC_FEATURES | OPS_FEATURES | SERVING_FEATURES
                                        | MEGATRON_FEATURES | HEALTH_FEATURES)

# Flags whose feature is built for some values only: dest -> supported values.
SUPPORTED_VALUES: dict[str, frozenset] = {
    "advantage_estimator": frozenset({"grpo", "gspo", "sapo", "cispo", "rloo"}),
    "loss_type": frozenset({"policy_loss"}),
    # "sglang": tests/test_sglang_cpu.py drives the controller with real SGLang on CPU (needs the
    # separate venv from scripts/install_sglang_cpu.sh; skipped when it is absent).
    "rollout_backend": frozenset({"auto", "embedded", "sglang"}),
    # raw: relax/backends/megatron/hf_weights.py (tests/test_megatron_hf.py). bridge: refused for a dependency
    # conflict (relax.config.support_deps: no Megatron-Bridge release installs beside transformers 5).
    "megatron_to_hf_mode": frozenset({"raw"}),
}
for _dest, _values in TRAINING_SUPPORTED_VALUES.items():
    SUPPORTED_VALUES[_dest] = SUPPORTED_VALUES.get(_dest, frozenset()) | frozenset(_values)


# SGLang server flags that only size or speed up an SGLang server (GPU memory, CUDA graphs, compilation, its
# internal data/expert parallelism, logging): the same samples come out without them. Launch scripts pass them
# unchanged; with the embedded engine (the CPU backend) they are accepted and have no effect, with a warning
# (`no_effect_flags`). Every other SGLang server flag with the embedded engine is refused: it could change what
# the engine generates.
SGLANG_RESOURCE_FLAGS: frozenset[str] = frozenset({
    "sglang_mem_fraction_static", "sglang_cuda_graph_bs", "sglang_cuda_graph_max_bs", "sglang_disable_cuda_graph",
    "sglang_enable_torch_compile", "sglang_chunked_prefill_size", "sglang_dp_size", "sglang_ep_size",
    "sglang_enable_dp_attention", "sglang_moe_a2a_backend", "sglang_enable_memory_saver", "sglang_log_level",
})

# SGLang server flags the embedded engine honours itself (relax.roles.engine.engine_server_args passes them on).
# --sglang-disable-radix-cache: every copy of a prompt prefilled on its own (relax.backends.embedded.prefix).
EMBEDDED_SGLANG_FLAGS: frozenset[str] = frozenset({"sglang_disable_radix_cache"})


def _no_effect_dests(config: Config) -> dict[str, str]:
    """dest -> --flag name of each flag set to a non-default value that has no effect in this run: SGLang resource
    flags while the engines are not SGLang servers, and the Megatron flags of `support_megatron.NO_EFFECT_REASONS`."""
    defaults = config.meta.get("defaults", {})
    names = config.meta.get("flag_names", {})
    sglang = not uses_sglang_engines(config)
    return {dest: names.get(dest, "--" + dest.replace("_", "-")) for dest in sorted(config.explicit)
            if ((sglang and dest in SGLANG_RESOURCE_FLAGS) or dest in NO_EFFECT_REASONS)
            and not (dest in defaults and same_value(config[dest], defaults[dest]))}


def no_effect_flags(config: Config) -> list[str]:
    """The flags the user set that have no effect in this run (as --flag names; see `_no_effect_dests`)."""
    return list(_no_effect_dests(config).values())


# A no-effect flag's --flag names (every option string of a mirrored Megatron flag) -> its dest.
_NO_EFFECT_NAMES: dict[str, str] = {"--" + d.replace("_", "-"): d for d in NO_EFFECT_REASONS}
_NO_EFFECT_NAMES.update({opt: row[2] for row in MEGATRON_ROWS if row[2] in NO_EFFECT_REASONS for opt in row[1]})


def no_effect_dest(name: str) -> str | None:
    """The dest of a --flag name of `support_megatron.NO_EFFECT_REASONS` (None for any other flag)."""
    return _NO_EFFECT_NAMES.get(name)


def no_effect_warnings(flags: list[str]) -> list[str]:
    """One warning per flag of `no_effect_flags`, saying what has no effect and what Relax does instead (the
    SGLang resource flags share one)."""
    megatron = {no_effect_dest(f): f for f in flags if no_effect_dest(f)}
    sglang = [f for f in flags if not no_effect_dest(f)]
    out = no_effect_lines(megatron)
    if sglang:
        out.insert(0, f"{', '.join(sglang)}: no effect with the embedded engine (rollout backend embedded); "
                      "these size or speed up SGLang servers and apply with --rollout-backend sglang")
    return out


# --resource keys of the reference's launch scripts whose stage runs on the actor's ranks, not a role of its own
RESOURCE_ON_ACTOR = {
    "actor_fwd": "the actor's forward pass (old log-probs) runs on the actor's ranks",
    "advantages": "the advantages are computed on the actor's rank 0",
}


def resource_warnings(config: Config) -> list[str]:
    """One line per --resource entry that places nothing in this run (its stage runs on the actor's ranks)."""
    res = config.resource or {}
    return [f"--resource {key} {res[key]}: no effect; {why}, which --resource actor sizes"
            for key, why in RESOURCE_ON_ACTOR.items() if key in res]


def no_effect_warning(flags: list[str]) -> str:
    """`no_effect_warnings` as the text `relax-train` prints after "relax-train: warning: " (one line each)."""
    return "\nrelax-train: warning: ".join(no_effect_warnings(flags))


def unsupported_flags(config: Config, implemented: frozenset[str] = IMPLEMENTED) -> list[str]:
    """Flags the user set to a non-default value whose feature is not built yet (as --flag names)."""
    defaults = config.meta.get("defaults", {})
    names = config.meta.get("flag_names", {})
    out = []
    sglang_engines = None  # resolved lazily: only when an --sglang-* server flag is set
    for dest in sorted(config.explicit):
        if dest in implemented and (dest not in SUPPORTED_VALUES or is_supported_value(dest, config[dest])):
            continue
        if dest in defaults and same_value(config[dest], defaults[dest]):
            continue
        if dest in NO_EFFECT_REASONS:
            continue  # accepted with a warning (`no_effect_flags`)
        name = names.get(dest, "--" + dest.replace("_", "-"))
        if is_sglang_server_flag(dest):
            if sglang_engines is None:
                sglang_engines = uses_sglang_engines(config)
            if sglang_engines or dest in SGLANG_RESOURCE_FLAGS or dest in EMBEDDED_SGLANG_FLAGS:
                continue  # forwarded to every SGLang server (relax.roles.engine.engine_server_args), or no effect
            out.append(f"{name} (an SGLang server flag: honoured only with --rollout-backend sglang)")
            continue
        why = dependency_reason(dest, config[dest]) if dest in SUPPORTED_VALUES else None
        if why:
            out.append(f"{name} {config[dest]} ({DEPENDENCY_MARK}{why})")
            continue
        out.append(f"{name} {config[dest]}" if dest in SUPPORTED_VALUES else name)
    return out


# How `unsupported_flags` marks a value refused for a stated dependency reason (relax.config.support_deps)
DEPENDENCY_MARK = "a dependency conflict: "


def _normal(value: Any) -> Any:
    """A comparable form: enums by name, a list of one by its element, numbers as floats.

    Megatron keeps some scalars in lists (`--moe-aux-loss-coeff 0` parses to [0.0] while its default is
    0.0), enum flags hold an Enum from Megatron's parser but a string from the mirror or a config file,
    and a YAML file may write 0 for a float flag: none of these is a different value.
    """
    if isinstance(value, enum.Enum):
        return str(value.name)
    if isinstance(value, (list, tuple)):
        items = tuple(_normal(v) for v in value)
        return items[0] if len(items) == 1 else items
    if isinstance(value, dict):
        return tuple(sorted((str(k), _normal(v)) for k, v in value.items()))
    if isinstance(value, float):  # integral floats compare as ints (exact, even past 2**53); NaN equals NaN
        return "nan" if math.isnan(value) else int(value) if value.is_integer() else value
    return value


def same_value(a: Any, b: Any) -> bool:
    """Whether two flag values are equal by value (see `_normal`)."""
    if a is b:
        return True
    try:
        return _normal(a) == _normal(b)
    except TypeError:  # unhashable or odd objects: plain equality
        return a == b


def is_supported_value(dest: str, value: Any) -> bool:
    return any(same_value(value, ok) for ok in SUPPORTED_VALUES[dest])


def is_sglang_server_flag(dest: str) -> bool:
    return dest.startswith("sglang_") and not dest.startswith("sglang_router_")


def uses_sglang_engines(config: Config) -> bool:
    """Engines are real SGLang servers (`auto` is resolved by config validation)."""
    return config.rollout_backend == "sglang"


def require_supported(config: Config) -> None:
    missing = unsupported_flags(config)
    conflicts = [m for m in missing if DEPENDENCY_MARK in m]
    parts = []
    if len(conflicts) < len(missing):
        parts.append("not supported yet: " + ", ".join(m for m in missing if m not in conflicts)
                     + " (these flags are accepted but their features are not built; "
                       "remove them, or see `relax-train --dry-run` for the full list)")
    if conflicts:  # "--flag value (a dependency conflict: why; fix)"
        parts.append("refused: " + "; ".join(conflicts))
    if parts:
        raise ConfigError(". ".join(parts))
