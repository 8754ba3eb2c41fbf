"""Every cross-flag rule and every derived value, in one place.

`validate_and_derive(values, explicit)` runs after all sources (defaults, config files, command
line) are merged. It raises `ConfigError` naming the flags and the fix, or returns the completed
values; `derived_facts(values)` adds the derived values that are not flags (`DERIVED_FACTS`). Nothing
else in Relax computes a derived value: roles read the stored one.
"""

from __future__ import annotations

import importlib
import logging
import math
from pathlib import Path
from typing import Any, Callable

from relax.config import facts, rules_arch, rules_recompute, rules_rollout, rules_streaming, rules_training
from relax.config.errors import ConfigError
from relax.config.hook_paths import current_module, moved_path_warning
from relax.config.presets import apply_embedded_default
from relax.config.sglang import owned_flag_error, resolve_backend
from relax.formats.prompt_files import PromptDataError, count_prompt_records
from relax.formats.replay_record import recorded_run

RESOURCE_ROLES = ("actor", "rollout", "critic", "reference", "actor_fwd", "advantages", "genrm", "teacher")

logger = logging.getLogger("relax")

# Dotted-path hooks that must import when set.
HOOK_FLAGS = (
    "data_source_path", "rollout_function_path", "custom_generate_function_path",
    "rollout_data_postprocess_path", "custom_rollout_log_function_path",
    "custom_eval_rollout_log_function_path", "dynamic_sampling_filter_path", "buffer_filter_path",
    "custom_loss_function_path", "custom_tis_function_path", "custom_pg_loss_reducer_function_path",
    "custom_rm_path", "custom_reward_post_process_path", "custom_convert_samples_to_train_data_path",
    "eval_function_path", "custom_model_provider_path",
)

POSITIVE_INTS = (
    "n_samples_per_prompt", "rollout_batch_size", "num_rollout", "num_epoch", "global_batch_size",
    "micro_batch_size", "num_steps_per_rollout", "max_tokens_per_gpu", "log_probs_max_tokens_per_gpu",
    "rollout_max_response_len", "rollout_max_prompt_len", "rollout_max_context_len",
    "num_data_storage_units", "update_weights_interval", "save_interval", "eval_interval",
    "n_samples_per_eval_prompt", "rollout_num_gpus_per_engine", "num_gpus_per_node",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "update_weight_buffer_size", "over_sampling_batch_size",
    "streaming_buffer_size", "num_iters_per_train_update", "max_actor_ckpt_to_keep",
    "ref_update_interval", "partial_rollout_max_aborted_count", "genrm_num_gpus",
    "genrm_num_gpus_per_engine",
)
NON_NEGATIVE = ("max_staleness", "num_critic_only_steps", "critic_lr_warmup_iters", "entropy_coef",
                "kl_coef", "kl_loss_coef", "max_global_restart", "mm_processor_pool_size",
                "rollout_health_check_first_wait", "tis_clip_low", "start_rollout_id")


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def validate_and_derive(values: dict[str, Any], explicit: frozenset[str],
                        defaults: dict[str, Any] | None = None) -> tuple[dict[str, Any], bool]:
    """Returns (completed values, whether the embedded default preset is in use).

    `defaults` are the parser defaults; hooks left at their default are Relax's own (tested in CI).
    """
    v = dict(values)
    defaults = defaults or {}
    explicit = frozenset(d for d in explicit if d not in HOOK_FLAGS or v.get(d) != defaults.get(d, object()))
    embedded = apply_embedded_default(v, explicit)
    apply_replay_record(v, explicit)
    for rule in RULES + tuple(rules_training.RULES) + tuple(rules_rollout.RULES):
        if not (embedded and rule is check_data):  # the embedded data is created at start-up
            rule(v, explicit)
    rules_arch.check_arch_flags(v, explicit, defaults)
    rules_recompute.check(v, explicit)
    derive(v, explicit)
    for rule in POST_DERIVE_RULES + tuple(rules_rollout.POST_DERIVE_RULES):
        rule(v, explicit)
    return v, embedded


def restated_derivations(values: dict[str, Any], explicit: frozenset[str], defaults: dict[str, Any]) -> frozenset[str]:
    """Derived dests the user set to exactly the value Relax would derive anyway.

    A resolved config (from --dry-run) lists every derived value; reloading it must not make those
    look like user choices. Returns the dests to drop from `explicit`.
    """
    given = DERIVED & explicit
    if not given:
        return frozenset()
    baseline = dict(values)
    for dest in given:
        baseline[dest] = defaults.get(dest)
    try:
        apply_embedded_default(baseline, explicit - given)
        derive(baseline, explicit - given)
    except ConfigError:
        return frozenset()
    return frozenset(d for d in given if baseline.get(d) == values.get(d))


# --------------------------------------------------------------------------- value ranges

def apply_replay_record(v: dict, explicit) -> None:
    """A replay (`--load-debug-rollout-data`) takes the model and batch shape recorded in its file."""
    template = v.get("load_debug_rollout_data")
    if not template:
        return
    try:
        record = recorded_run(template, v.get("start_rollout_id") or 0)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"--load-debug-rollout-data: {exc}") from None
    for dest, value in (record or {}).items():
        if dest not in v or value is None:
            continue
        if dest in explicit and v[dest] != value:
            raise ConfigError(f"{flag(dest)} {v[dest]} differs from the value the replayed rollouts were generated "
                              f"with ({value}, recorded in {template}); drop {flag(dest)} to use the recorded one")
        v[dest] = value


def check_ranges(v: dict, explicit) -> None:
    for dest in POSITIVE_INTS:
        val = v.get(dest)
        if val is not None and val < 1:
            raise ConfigError(f"{flag(dest)} must be >= 1, got {val}")
    for dest in NON_NEGATIVE:
        val = v.get(dest)
        if val is not None and (not math.isfinite(val) or val < 0):
            raise ConfigError(f"{flag(dest)} must be >= 0, got {val}")
    for dest in ("lr", "eps_clip", "eps_clip_high", "value_clip", "tis_clip", "opsm_delta", "critic_lr",
                 "sapo_tau_pos", "sapo_tau_neg", "clip_grad", "weight_decay", "opd_kl_coef", "gamma", "lambd"):
        val = v.get(dest)
        if val is not None and (not math.isfinite(val) or val < 0):
            raise ConfigError(f"{flag(dest)} must be a finite number >= 0, got {val}")
    if v.get("eps_clip_c") is not None and not v["eps_clip_c"] > 1.0:
        raise ConfigError(f"--eps-clip-c (dual clip) must be > 1, got {v['eps_clip_c']}")
    if v.get("tis_clip") is not None and v.get("tis_clip_low") is not None and v["tis_clip_low"] > v["tis_clip"]:
        raise ConfigError("--tis-clip-low must not exceed --tis-clip")
    sub = v.get("load_debug_rollout_data_subsample")
    if sub is not None and not 0 < sub <= 1:
        raise ConfigError(f"--load-debug-rollout-data-subsample must be in (0, 1], got {sub}")
    for g in ("gamma", "lambd"):
        if v.get(g) is not None and v[g] > 1:
            raise ConfigError(f"{flag(g)} must be in [0, 1], got {v[g]}")


def check_sampling(v: dict, explicit) -> None:
    for prefix in ("rollout", "eval"):
        temp, top_p, top_k = v.get(f"{prefix}_temperature"), v.get(f"{prefix}_top_p"), v.get(f"{prefix}_top_k")
        if temp is not None and not (math.isfinite(temp) and temp > 0):
            raise ConfigError(f"--{prefix}-temperature must be a finite number > 0, got {temp}")
        if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise ConfigError(f"--{prefix}-top-p must be in (0, 1], got {top_p}")
        if top_k is not None and not (top_k == -1 or top_k >= 1):
            raise ConfigError(f"--{prefix}-top-k must be -1 (off) or >= 1, got {top_k}")
    stops = v.get("rollout_stop_token_ids") or []
    if any(t < 0 for t in stops):
        raise ConfigError("--rollout-stop-token-ids must be non-negative token ids")


# --------------------------------------------------------------------------- combinations

def check_algorithm(v: dict, explicit) -> None:
    if v["kl_coef"] and v["kl_loss_coef"]:
        raise ConfigError("--kl-coef (reward shaping) and --kl-loss-coef (loss term) cannot both be non-zero; "
                          "set one of them to 0")
    if v["kl_loss_coef"] and not v["use_kl_loss"]:
        raise ConfigError("--kl-loss-coef has no effect without --use-kl-loss; add --use-kl-loss")
    if v["loss_type"] == "custom_loss" and not v["custom_loss_function_path"]:
        raise ConfigError("--loss-type custom_loss needs --custom-loss-function-path")
    if v["advantage_estimator"] in ("reinforce_plus_plus", "reinforce_plus_plus_baseline") and not v["normalize_advantages"]:
        raise ConfigError(f"--advantage-estimator {v['advantage_estimator']} needs --normalize-advantages "
                          "(its returns are whitened over the batch)")
    if v["use_opd"] and not v["opd_type"]:
        raise ConfigError("--use-opd needs --opd-type sglang or --opd-type megatron")
    if v["opd_type"] and not v["use_opd"]:
        raise ConfigError("--opd-type has no effect without --use-opd; add --use-opd")
    if v["opd_type"] == "megatron" and not v["opd_teacher_load"]:
        raise ConfigError("--opd-type megatron needs --opd-teacher-load (the teacher checkpoint)")
    if v["only_train_params_name_list"] and v["freeze_params_name_list"]:
        raise ConfigError("--only-train-params-name-list and --freeze-params-name-list are exclusive; use one")
    if v["get_mismatch_metrics"] and not v["custom_tis_function_path"]:
        raise ConfigError("--get-mismatch-metrics needs --custom-tis-function-path")
    if v["critic_train_only"] and v["advantage_estimator"] != "ppo":
        raise ConfigError("--critic-train-only needs --advantage-estimator ppo (only ppo has a critic)")
    if v["num_critic_only_steps"] and v["advantage_estimator"] != "ppo":
        raise ConfigError("--num-critic-only-steps needs --advantage-estimator ppo")


def check_batching(v: dict, explicit) -> None:
    if v["use_dynamic_batch_size"] and not v["max_tokens_per_gpu"]:
        raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu (the token budget per micro-batch)")
    if v["use_dynamic_batch_size"] and v["qkv_format"] == "bshd":
        raise ConfigError("--qkv-format bshd does not support --use-dynamic-batch-size; use --qkv-format thd "
                          "or a fixed --micro-batch-size")
    if v["balance_data"] and v["fully_async"]:
        # Public fully-async launch scripts set both. The async loop trains each step with the same train
        # stage (relax.core.async_loop), which balances that step across data-parallel ranks: say so.
        logger.warning("--balance-data with --fully-async: no effect on the rollout or the staleness window; "
                       "the trainer balances each trained step across its data-parallel ranks as in sync mode")
    elif v["balance_data"] and not v["colocate"]:
        raise ConfigError("--balance-data works only in colocated mode; add --colocate or drop --balance-data")
    rbs, over = v["rollout_batch_size"], v["over_sampling_batch_size"]
    if over is not None and rbs is not None and over < rbs:
        raise ConfigError(f"--over-sampling-batch-size ({over}) must be >= --rollout-batch-size ({rbs})")
    if v["max_staleness"] and not v["fully_async"]:
        raise ConfigError("--max-staleness > 0 needs --fully-async (the synchronous loop is on-policy)")


def check_checkpointing(v: dict, explicit) -> None:
    if v["rotate_ckpt"] and not (v["save"] and v["save_interval"] and v["async_save"]):
        missing = [f for f, d in (("--save", "save"), ("--save-interval", "save_interval"),
                                  ("--async-save", "async_save")) if not v[d]]
        raise ConfigError(f"--rotate-ckpt needs --save, --save-interval and --async-save; missing {', '.join(missing)}")
    if v.get("fp16") and v.get("bf16"):
        raise ConfigError("--fp16 and --bf16 are exclusive; choose one precision")


def check_modes(v: dict, explicit) -> None:
    if v["debug_rollout_only"] and (v["debug_train_only"] or v["load_debug_rollout_data"]):
        raise ConfigError("--debug-rollout-only cannot be combined with --debug-train-only/--load-debug-rollout-data")
    if v["colocate"] and v["fully_async"]:
        raise ConfigError("--colocate cannot be combined with --fully-async: colocated engines and trainer ranks "
                          "share devices and take turns, so rollout cannot run beside training; drop one of them")
    if v["colocate"]:
        check_colocate(v)
    if v["rollout_external"] and not v["rollout_external_engine_addrs"]:
        raise ConfigError("--rollout-external needs --rollout-external-engine-addrs HOST:PORT [...]")
    if v["rollout_external_engine_addrs"] and not v["rollout_external"]:
        raise ConfigError("--rollout-external-engine-addrs needs --rollout-external")
    for addr in v["rollout_external_engine_addrs"] or []:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--rollout-external-engine-addrs: {addr!r} is not HOST:PORT")
    if not v["partial_rollout"]:
        for dest in ("partial_rollout_max_aborted_count", "mask_offpolicy_in_partial_rollout"):
            if v[dest]:
                raise ConfigError(f"{flag(dest)} has no effect without --partial-rollout; add --partial-rollout")
    pairs = v["eval_prompt_data"]
    if pairs is not None and len(pairs) % 2:
        raise ConfigError("--eval-prompt-data takes NAME PATH pairs; got an odd number of values")
    if v["use_rollout_routing_replay"] and v.get("num_experts") in (None, 0) and "num_experts" in v:
        pass  # routing replay on a dense model is a no-op; allowed (the model may come from --hf-checkpoint)


def check_colocate(v: dict) -> None:
    """--colocate puts engine i on trainer rank i's device (relax.roles.placement.colocated_bundles)."""
    if v["rollout_external"]:
        raise ConfigError("--colocate cannot share devices with --rollout-external engines; drop one of them")
    res = v["resource"] or {}
    actor, rollout = res.get("actor", [1, 1]), res.get("rollout", [1, 1])
    if rollout[0] * rollout[1] > actor[0] * actor[1]:
        raise ConfigError(f"--colocate: --resource rollout ({rollout[0] * rollout[1]} GPUs) cannot exceed actor "
                          f"({actor[0] * actor[1]} GPUs); colocated engines use the trainer's devices")


def check_data(v: dict, explicit) -> None:
    """The prompt file exists (its rows are checked before the run starts, by relax.core.preflight)."""
    if v["prompt_data"]:
        if not Path(v["prompt_data"]).is_file():
            raise ConfigError(f"--prompt-data: file not found: {v['prompt_data']}")
        if not v["input_key"]:
            raise ConfigError("--input-key is empty; name the field of the prompt rows that holds the prompt")
        if v["rollout_batch_size"] is None:
            raise ConfigError("--rollout-batch-size is required with --prompt-data (prompts per rollout step)")
        if v["num_rollout"] is None and v["num_epoch"] is None and not v["dry_run"]:
            raise ConfigError("set --num-rollout (steps) or --num-epoch (passes over --prompt-data)")
    elif not v["debug_train_only"] and not v["load_debug_rollout_data"]:
        if "prompt_data" in explicit:
            raise ConfigError("--prompt-data is empty")


def check_resource(v: dict, explicit) -> None:
    res = v["resource"]
    if res is None:
        return
    for role, spec in res.items():
        if role not in RESOURCE_ROLES:
            raise ConfigError(f"--resource: unknown role {role!r}; roles are {', '.join(RESOURCE_ROLES)}")
        if (not isinstance(spec, list) or len(spec) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in spec)):
            raise ConfigError(f"--resource: {role} must be [replicas, gpus] (two integers >= 0), got {spec!r}")


def check_sglang(v: dict, explicit) -> None:
    for dest in explicit:
        if dest.startswith("sglang_") and not dest.startswith("sglang_router_"):
            msg = owned_flag_error(dest)
            if msg:
                raise ConfigError(msg)


def check_hooks(v: dict, explicit) -> None:
    for dest in HOOK_FLAGS:
        path = v.get(dest)
        if path and dest in explicit:
            import_hook(path, flag(dest))
            moved = moved_path_warning(path, flag(dest))
            if moved:
                logger.warning("%s", moved)


def load_hook(path: str | None, flag_name: str) -> Callable | None:
    """The function a hook flag names (None when the flag is unset); errors name the flag."""
    return import_hook(path, flag_name) if path else None


def import_hook(path: str, flag_name: str = "hook") -> Callable:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ConfigError(f"{flag_name}: {path!r} is not a dotted path like package.module.function")
    try:
        module = importlib.import_module(current_module(module_name))  # a moved module: relax.config.hook_paths
    except Exception as exc:
        raise ConfigError(f"{flag_name}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})") from None
    if not hasattr(module, attr):
        raise ConfigError(f"{flag_name}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


# Dests that derive() may fill in from other flags, each with what it becomes when left unset. The
# words are what `relax-train --help` shows as the flag's default (relax.config.help_text); a test
# checks every derived value the parser produces is listed here.
DERIVED_FROM: dict[str, str] = {
    "eps_clip_high": "--eps-clip",
    "critic_lr": "--lr",
    "critic_load": "--load",
    "offload": "on with --colocate, else off",
    "offload_train": "on with --offload, else off",
    "offload_rollout": "on with --offload, else off",
    "debug_train_only": "on with --load-debug-rollout-data, else off",
    "use_routing_replay": "on with --use-rollout-routing-replay, else off",
    "over_sampling_batch_size": "--rollout-batch-size",
    "log_probs_max_tokens_per_gpu": "--max-tokens-per-gpu",
    "eval_input_key": "--input-key",
    "eval_label_key": "--label-key",
    "eval_tool_key": "--tool-key",
    "eval_reward_key": "--reward-key",
    "eval_temperature": "--rollout-temperature",
    "eval_top_p": "--rollout-top-p",
    "eval_top_k": "--rollout-top-k",
    "eval_max_response_len": "--rollout-max-response-len",
    "eval_max_prompt_len": "--rollout-max-prompt-len",
    "eval_max_context_len": "--rollout-max-context-len",
    "resource": '{"actor": [1, 1], "rollout": [1, 1]}',
    "rollout_backend": "auto resolves before the run starts: sglang when a GPU and SGLang are present, else embedded",
    "save": "<output-dir>/checkpoints when --save-interval is set",
    "num_rollout": "--num-epoch x usable prompts / --rollout-batch-size, when --num-epoch is set",
    "global_batch_size": "samples per rollout / --num-steps-per-rollout (samples per rollout without it)",
    "lr_decay_iters": "--num-rollout x optimizer steps per rollout (the whole run)",
    "save_debug_rollout_data": "<--dump-details>/rollout_data/{rollout_id}.jsonl with --dump-details",
    "save_debug_train_data": "<--dump-details>/train_data/{rollout_id}_{rank}.pt with --dump-details",
}
DERIVED = frozenset(DERIVED_FROM)

RULES = (check_ranges, check_sampling, check_algorithm, check_batching, check_checkpointing, check_modes,
         check_data, check_resource, check_sglang, check_hooks)


# --------------------------------------------------------------------------- derived values

def count_prompts(v: dict) -> int:
    """Usable rows of --prompt-data, read as training reads them (bad rows fail, or are skipped and not
    counted with --skip-bad-lines)."""
    try:
        return count_prompt_records(v["prompt_data"], input_key=v["input_key"], label_key=v["label_key"],
                                    metadata_key=v["metadata_key"], tool_key=v["tool_key"],
                                    skip_bad_lines=bool(v["skip_bad_lines"]))
    except PromptDataError as exc:
        raise ConfigError(f"--prompt-data: {exc} (fix the row, or add --skip-bad-lines to skip and count bad "
                          "rows)") from None


def derive(v: dict, explicit) -> None:
    if v["eps_clip_high"] is None:
        v["eps_clip_high"] = v["eps_clip"]
    if v["critic_lr"] is None:
        v["critic_lr"] = v["lr"]
    if v["critic_load"] is None:
        v["critic_load"] = v["load"]
    if v["colocate"]:
        v["offload"] = True
    if v["offload"]:
        v["offload_train"] = True
        v["offload_rollout"] = True
    for dest in ("offload_train", "offload_rollout"):
        if v[dest] is None:
            v[dest] = False
    if v["load_debug_rollout_data"]:
        v["debug_train_only"] = True
    if v.get("dump_details"):  # one directory with every step's rollout and training data (and the config)
        base = Path(v["dump_details"])
        if v["save_debug_rollout_data"] is None:
            v["save_debug_rollout_data"] = str(base / "rollout_data" / "{rollout_id}.jsonl")
        if v["save_debug_train_data"] is None:
            v["save_debug_train_data"] = str(base / "train_data" / "{rollout_id}_{rank}.pt")
    if v["use_rollout_routing_replay"]:
        v["use_routing_replay"] = True
    if v["over_sampling_batch_size"] is None:
        v["over_sampling_batch_size"] = v["rollout_batch_size"]
    if v["log_probs_max_tokens_per_gpu"] is None:
        v["log_probs_max_tokens_per_gpu"] = v["max_tokens_per_gpu"]
    for key in ("input_key", "label_key", "tool_key"):
        if v[f"eval_{key}"] is None:
            v[f"eval_{key}"] = v[key]
    if v["eval_reward_key"] is None:
        v["eval_reward_key"] = v["reward_key"]
    for key in ("temperature", "top_p", "top_k", "max_response_len", "max_prompt_len", "max_context_len"):
        if v[f"eval_{key}"] is None:
            v[f"eval_{key}"] = v[f"rollout_{key}"]
    if v["resource"] is None:
        v["resource"] = {"actor": [1, 1], "rollout": [1, 1]}
    if v["rollout_backend"] == "auto":  # once, here: an actor without a GPU would see none
        v["rollout_backend"] = resolve_backend(v["rollout_backend"])
    if v["save"] is None and v["save_interval"] is not None:
        v["save"] = str(Path(v["output_dir"]) / "checkpoints")
    if v["num_rollout"] is None and v["num_epoch"] is not None and v["prompt_data"]:
        per_step = v["rollout_batch_size"]
        v["num_rollout"] = max(1, v["num_epoch"] * count_prompts(v) // per_step)
    samples = facts.samples_per_step(v)
    if v["num_steps_per_rollout"] is not None and samples:
        if samples % v["num_steps_per_rollout"]:
            raise ConfigError(f"--num-steps-per-rollout ({v['num_steps_per_rollout']}) must divide the samples per "
                              f"rollout ({samples} = --rollout-batch-size x --n-samples-per-prompt)")
        gbs = samples // v["num_steps_per_rollout"]
        if "global_batch_size" in explicit and v["global_batch_size"] != gbs:
            raise ConfigError(f"--global-batch-size {v['global_batch_size']} contradicts --num-steps-per-rollout "
                              f"{v['num_steps_per_rollout']} (which gives {gbs}); set only one")
        v["global_batch_size"] = gbs
    elif v["global_batch_size"] is None and samples:
        v["global_batch_size"] = samples
    if v.get("lr_decay_iters") is None and v["num_rollout"] and v["global_batch_size"] and samples:
        # Megatron decays over the whole run by default: optimizer steps per rollout x rollouts.
        v["lr_decay_iters"] = v["num_rollout"] * max(1, samples // v["global_batch_size"])
        # Megatron's scheduler needs decay steps beyond the warm-up; short runs keep the warm-up whole.
        v["lr_decay_iters"] = max(v["lr_decay_iters"], (v.get("lr_warmup_iters") or 0) + 1)
    elif v.get("lr_decay_iters") is not None and (v.get("lr_warmup_iters") or 0) >= v["lr_decay_iters"]:
        raise ConfigError(f"--lr-warmup-iters ({v['lr_warmup_iters']}) must be smaller than --lr-decay-iters "
                          f"({v['lr_decay_iters']})")


# Values derived from the flags that are not flags themselves: Config attributes (relax.config.config),
# computed here once. name -> what it is.
DERIVED_FACTS: dict[str, str] = {
    "actor_world_size": "trainer ranks: replicas x GPUs of --resource actor",
    "data_parallel_size": "actor_world_size / (tensor x pipeline x context parallel)",
    "num_engines": "rollout engines: the --rollout-external-engine-addrs, else the --resource rollout GPUs / "
                   "--rollout-num-gpus-per-engine (at least one)",
    "samples_per_step": "samples of one rollout step: --rollout-batch-size x --n-samples-per-prompt",
    "data_queue_samples": "samples the data plane holds at most: samples_per_step x (--max-staleness + 1)",
    "model_parallel_size": "ranks holding one copy of the model: tensor x pipeline x context parallel",
    "reference_placement": "where the reference log-probs are computed: none | role (its own actors) | in_rank "
                           "(the actor ranks' processes) | child_process (a child of the one actor rank) | "
                           "streamed (that child, also streaming later updates' old-policy rows); see "
                           "relax.config.facts.reference_placement",
    "shares_idle_cores": "whether the fully-async trainer takes the cores its neighbours leave idle (CPU, "
                         "--max-staleness >= 1, a model at least 256 wide; relax.config.facts.shares_idle_cores)",
}


def derived_facts(v: dict) -> dict[str, Any]:
    """`DERIVED_FACTS` of completed values (after `validate_and_derive`)."""
    world = facts.role_workers(v, "actor")
    shares_cores = facts.shares_idle_cores(v)  # reads the model's config.json: once, for both facts that need it
    if v["rollout_external"]:
        engines = len(v["rollout_external_engine_addrs"] or [])
    else:
        engines = max(1, facts.role_workers(v, "rollout") // v["rollout_num_gpus_per_engine"])
    return {"actor_world_size": world, "data_parallel_size": facts.data_parallel_size(v),
            "num_engines": engines, "samples_per_step": facts.samples_per_step(v),
            "data_queue_samples": facts.data_queue_samples(v),
            "model_parallel_size": facts.model_parallel_size(v),
            "reference_placement": facts.reference_placement(v, world, shares_cores),
            "shares_idle_cores": shares_cores}


def check_batch_arithmetic(v: dict, explicit) -> None:
    samples = facts.samples_per_step(v)
    gbs = v["global_batch_size"]
    if samples and gbs and samples % gbs:
        raise ConfigError(f"--global-batch-size ({gbs}) must divide the samples per rollout ({samples} = "
                          "--rollout-batch-size x --n-samples-per-prompt)")
    world, model_parallel = facts.role_workers(v, "actor"), facts.model_parallel_size(v)
    dp = facts.data_parallel_size(v)
    if world < 1:
        raise ConfigError(f"--resource actor {v['resource'].get('actor')} has no worker; the trainer needs at least "
                          "one (replicas x GPUs >= 1)")
    if world % model_parallel:
        raise ConfigError(f"--resource actor has {world} workers, not divisible by tensor x pipeline x context "
                          f"parallel = {model_parallel}")
    if gbs and not v["use_dynamic_batch_size"] and gbs % (v["micro_batch_size"] * dp):
        raise ConfigError(f"--global-batch-size ({gbs}) must be a multiple of --micro-batch-size "
                          f"({v['micro_batch_size']}) x data-parallel size ({dp})")
    gpus = facts.role_workers(v, "rollout")
    if not v["rollout_external"] and gpus and gpus % v["rollout_num_gpus_per_engine"]:
        raise ConfigError(f"--resource rollout has {gpus} GPUs, not a multiple of --rollout-num-gpus-per-engine "
                          f"({v['rollout_num_gpus_per_engine']})")


def check_streaming_chunks(v: dict, explicit) -> None:
    rules_streaming.check(v, facts.data_parallel_size(v))


POST_DERIVE_RULES = (check_batch_arithmetic, check_streaming_chunks)
