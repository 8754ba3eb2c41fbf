"""Cross-flag rules of rollout features: functions (values, explicit) -> None raising ConfigError.
validate.py runs every function listed in RULES after its own rules, and those in POST_DERIVE_RULES
once the derived values (eval fallbacks, the resolved --rollout-backend) are filled in."""

from __future__ import annotations

import importlib
from typing import Any, Optional

from relax.config.middleware_paths import MiddlewareError, load_middleware_factory, middleware_paths
from relax.config.autoscaler import load_autoscaler_config
from relax.config.errors import ConfigError
from relax.config.eval_sets import eval_sets
from relax.config.genrm_options import engine_config, sampling_config

MODALITIES = ("image", "video", "audio")


def check_multimodal_keys(mapping: Any) -> Optional[dict[str, str]]:
    """The validated --multimodal-keys mapping modality -> field (None when unset); errors name the flag and
    the fix."""
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


def check_eval(v: dict, explicit) -> None:
    has_sets = bool(v.get("eval_prompt_data") or v.get("eval_config"))
    if v.get("eval_prompt_data") and v.get("eval_config"):
        raise ConfigError("--eval-prompt-data and --eval-config are exclusive; list the sets in one of them")
    if has_sets and not v.get("eval_interval"):
        raise ConfigError("--eval-prompt-data/--eval-config need --eval-interval N (evaluate every N rollout "
                          "steps); without it no evaluation runs")
    if v.get("eval_interval") and not has_sets:
        raise ConfigError("--eval-interval needs --eval-prompt-data NAME PATH [...] or --eval-config FILE")
    if has_sets:
        eval_sets(v)  # files exist, keys are known (errors name the flag or file and key)


def check_debug(v: dict, explicit) -> None:
    if v.get("load_debug_rollout_data_subsample") is not None and not v.get("load_debug_rollout_data"):
        raise ConfigError("--load-debug-rollout-data-subsample has no effect without --load-debug-rollout-data")
    if v.get("debug_train_only") and not v.get("load_debug_rollout_data"):
        raise ConfigError("--debug-train-only trains on saved rollouts: add --load-debug-rollout-data PATH "
                          "(saved earlier with --save-debug-rollout-data)")
    for dest, flag in (("save_debug_rollout_data", "--save-debug-rollout-data"),
                       ("load_debug_rollout_data", "--load-debug-rollout-data")):
        path = v.get(dest)
        if path and "{rollout_id}" not in path and (v.get("num_rollout") or 0) > 1 and dest.startswith("save"):
            raise ConfigError(f"{flag} {path}: with more than one rollout step every step would overwrite the "
                              "same file; put {rollout_id} in the path")
    if v.get("load_debug_rollout_data") and v.get("eval_interval"):
        raise ConfigError("--load-debug-rollout-data runs without engines, so it cannot evaluate; drop "
                          "--eval-interval")


def check_filters(v: dict, explicit) -> None:
    path = v.get("dynamic_sampling_filter_path") or ""
    if path.endswith("check_reward_nonzero_std") and v.get("n_samples_per_prompt", 1) < 2:
        raise ConfigError("--dynamic-sampling-filter-path check_reward_nonzero_std drops every group when "
                          "--n-samples-per-prompt is 1 (a single reward has no spread); use n >= 2")


def check_multimodal(v: dict, explicit) -> None:
    if check_multimodal_keys(v["multimodal_keys"]) and v["rollout_backend"] == "embedded" \
            and not v["rollout_external"]:
        raise ConfigError("--multimodal-keys needs an engine that takes images/videos/audio (SGLang): the embedded "
                          "engine is text-only and would drop them; use --rollout-backend sglang (or an external "
                          "SGLang with --rollout-external) or drop --multimodal-keys")


def check_logging(v: dict, explicit) -> None:
    key = v.get("log_reward_category")
    if key is not None and not str(key).strip():
        raise ConfigError("--log-reward-category needs the key of the category in the dict-valued reward")


# Relax's router's flags with their reference defaults: another value without --use-slime-router has no effect.
_ROUTER_FLAGS = {"slime_router_middleware_paths": ("--slime-router-middleware-paths", None),
                 "slime_router_timeout": ("--slime-router-timeout", None),
                 "slime_router_max_connections": ("--slime-router-max-connections", None),
                 "slime_router_health_check_failure_threshold": ("--slime-router-health-check-failure-threshold", 3)}


def check_router(v: dict, explicit) -> None:
    """--use-slime-router and its flags (relax.backends.relax_router); middlewares are imported here, before Ray."""
    if not v.get("use_slime_router"):
        for dest, (name, default) in _ROUTER_FLAGS.items():
            if dest in explicit and (v.get(dest) or None) != default:
                raise ConfigError(f"{name} configures Relax's router: add --use-slime-router (or drop {name})")
        return
    if "sglang_router_policy" in explicit:
        raise ConfigError("--sglang-router-policy chooses sglang-router's policy; Relax's router (--use-slime-router) "
                          "routes by text prefix and load on its own: drop one of the two")
    if v.get("slime_router_timeout") is not None and not v["slime_router_timeout"] > 0:
        raise ConfigError(f"--slime-router-timeout must be > 0 seconds, got {v['slime_router_timeout']}")
    if v.get("slime_router_max_connections") is not None and v["slime_router_max_connections"] < 1:
        raise ConfigError(f"--slime-router-max-connections must be >= 1, got {v['slime_router_max_connections']}")
    if v.get("slime_router_health_check_failure_threshold", 3) < 1:
        raise ConfigError("--slime-router-health-check-failure-threshold must be >= 1, got "
                          f"{v['slime_router_health_check_failure_threshold']}")
    for path in middleware_paths(v.get("slime_router_middleware_paths")):
        try:
            load_middleware_factory(path)
        except MiddlewareError as exc:
            raise ConfigError(str(exc)) from None


_HEALTH_FLAGS = {"rollout_health_check_interval": ("--rollout-health-check-interval", 30.0),
                 "rollout_health_check_timeout": ("--rollout-health-check-timeout", 30.0),
                 "rollout_health_check_first_wait": ("--rollout-health-check-first-wait", 0.0)}


def check_fault_tolerance(v: dict, explicit) -> None:
    """--use-fault-tolerance and its probe settings (relax.rollout.engine_pool.HealthMonitor)."""
    if not v.get("use_fault_tolerance"):
        for dest, (name, default) in _HEALTH_FLAGS.items():
            if dest in explicit and float(v.get(dest) or 0) != default:
                raise ConfigError(f"{name} sets the engine health probes of --use-fault-tolerance: add "
                                  f"--use-fault-tolerance (or drop {name})")
        return
    if v.get("rollout_external"):
        raise ConfigError("--use-fault-tolerance restarts engines Relax started; with --rollout-external it cannot "
                          "restart yours: drop one of the two")
    if not v["rollout_health_check_interval"] > 0:
        raise ConfigError(f"--rollout-health-check-interval must be > 0 seconds, got "
                          f"{v['rollout_health_check_interval']}")
    if not v["rollout_health_check_timeout"] > 0:
        raise ConfigError(f"--rollout-health-check-timeout must be > 0 seconds, got {v['rollout_health_check_timeout']}")
    if v["rollout_health_check_first_wait"] < 0:
        raise ConfigError(f"--rollout-health-check-first-wait must be >= 0 seconds, got "
                          f"{v['rollout_health_check_first_wait']}")


_SCALE_FLAGS = {"scale_out_timeout": "--scale-out-timeout", "scale_in_drain_timeout": "--scale-in-drain-timeout",
                "scale_in_shutdown_timeout": "--scale-in-shutdown-timeout"}


def check_autoscaler(v: dict, explicit) -> None:
    """--autoscaler-config: the YAML is read and checked here, before Ray (relax.config.autoscaler), errors naming
    the file and the key; the scaling flags must be positive."""
    if not v.get("autoscaler_config"):
        return
    if v.get("rollout_external"):
        raise ConfigError("--autoscaler-config starts and stops engines; with --rollout-external Relax did not start "
                          "them: drop one of the two")
    if v.get("colocate"):
        raise ConfigError("--autoscaler-config adds engines on devices of their own; with --colocate the engines share "
                          "the trainer's: drop one of the two")
    load_autoscaler_config(v["autoscaler_config"])
    for dest, name in _SCALE_FLAGS.items():
        if not float(v[dest]) > 0:
            raise ConfigError(f"{name} must be > 0 seconds, got {v[dest]}")


# GenRM flags with their defaults: another value without --genrm-model-path has no effect.
_GENRM_FLAGS = {"genrm_num_gpus": ("--genrm-num-gpus", 1), "genrm_num_gpus_per_engine": ("--genrm-num-gpus-per-engine", 1),
                "genrm_engine_config": ("--genrm-engine-config", None),
                "genrm_sampling_config": ("--genrm-sampling-config", None),
                "genrm_template_path": ("--genrm-template-path", None),
                "genrm_parser_path": ("--genrm-parser-path", None)}


def _check_hook(path: str, name: str) -> None:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ConfigError(f"{name}: {path!r} is not a dotted path like package.module.function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"{name}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})") from None
    if not callable(getattr(module, attr, None)):
        raise ConfigError(f"{name}: module {module_name!r} has no function {attr!r}")


def check_genrm(v: dict, explicit) -> None:
    """--genrm-model-path and its flags (relax.rollout.genrm, relax.rollout.rewards.genrm): JSON configs and hooks
    are checked here, before Ray (the engine options once the rollout backend is resolved)."""
    if not v.get("genrm_model_path"):
        for dest, (name, default) in _GENRM_FLAGS.items():
            if dest in explicit and v.get(dest) != default:
                raise ConfigError(f"{name} configures the GenRM: add --genrm-model-path (or drop {name})")
        if v.get("rm_type") == "genrm":
            raise ConfigError("--rm-type genrm judges with the generative reward model: add --genrm-model-path")
        return
    if v.get("group_rm") and v.get("rm_type") == "genrm" and not v.get("custom_rm_path"):
        raise ConfigError("--group-rm with --rm-type genrm: the GenRM judges each sample on its own (no listwise "
                          "template is built); drop --group-rm, or score groups with --custom-rm-path")
    if v["genrm_num_gpus"] % v["genrm_num_gpus_per_engine"]:
        raise ConfigError(f"--genrm-num-gpus ({v['genrm_num_gpus']}) must be a multiple of "
                          f"--genrm-num-gpus-per-engine ({v['genrm_num_gpus_per_engine']})")
    sampling_config(v.get("genrm_sampling_config"))
    for dest, (name, _) in _GENRM_FLAGS.items():
        if dest.endswith("_path") and v.get(dest):
            _check_hook(v[dest], name)


def check_genrm_engines(v: dict, explicit) -> None:
    if v.get("genrm_model_path"):
        engine_config(v.get("genrm_engine_config"), v["rollout_backend"])


RULES: tuple = (check_debug, check_filters, check_logging, check_router, check_fault_tolerance, check_autoscaler,
                check_genrm)
POST_DERIVE_RULES: tuple = (check_eval, check_multimodal, check_genrm_engines)
