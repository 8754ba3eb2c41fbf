"""Cross-flag rules of training features: functions (values, explicit) -> None raising ConfigError.
validate.py runs every function listed in RULES after its own rules."""

import math
from typing import Optional

from relax.formats.checkpoint_layout import MARKER, latest_iteration
from relax.config import rules_checkpoint, rules_ddp, rules_lora
from relax.config.errors import ConfigError
from relax.config.facts import needs_reference, read_hf_config


def check_reference(v: dict, explicit) -> None:
    if v.get("ref_update_interval") is not None and not needs_reference(v):
        raise ConfigError("--ref-update-interval has no effect without a reference model; add --use-kl-loss "
                          "or --kl-coef, or drop --ref-update-interval")
    if v.get("use_unbiased_kl") and not v.get("use_kl_loss"):
        raise ConfigError("--use-unbiased-kl weights the KL loss term; add --use-kl-loss or drop --use-unbiased-kl")
    if v.get("ref_ckpt_step") is not None and not v.get("ref_load"):
        raise ConfigError("--ref-ckpt-step picks an iteration of --ref-load; add --ref-load or drop --ref-ckpt-step")
    res = v.get("resource") or {}
    if needs_reference(v) and res.get("reference") and res.get("actor"):
        ref, actor = res["reference"], res["actor"]
        if ref[0] * ref[1] != actor[0] * actor[1]:
            raise ConfigError(f"--resource reference {ref} must have as many workers as actor {actor} (the reference "
                              "uses the actor's parallel layout); make them equal or drop the reference entry")


def check_corrections(v: dict, explicit) -> None:
    if v.get("use_tis") and v.get("use_rollout_logprobs"):
        raise ConfigError("--use-tis weights by trainer/engine log-prob ratios, which --use-rollout-logprobs makes "
                          "identical; drop one of them")
    if v.get("custom_tis_function_path") and not (v.get("use_tis") or v.get("get_mismatch_metrics")):
        raise ConfigError("--custom-tis-function-path is used with --use-tis (or --get-mismatch-metrics); add one "
                          "of them or drop the path")
    if v.get("loss_type") == "sft" and (v.get("use_tis") or v.get("use_opsm")):
        raise ConfigError("--loss-type sft has no policy-gradient term for --use-tis / --use-opsm; drop them")
    if v.get("loss_type") == "custom_loss" and (v.get("use_tis") or v.get("use_opsm") or v.get("use_kl_loss")
                                                or v.get("custom_pg_loss_reducer_function_path")):
        raise ConfigError("--loss-type custom_loss replaces the whole loss; --use-tis, --use-opsm, --use-kl-loss and "
                          "--custom-pg-loss-reducer-function-path do not apply to it (drop them)")


def _same_workers(v: dict, role: str, why: str) -> None:
    res = v.get("resource") or {}
    if res.get(role) and res.get("actor"):
        mine, actor = res[role], res["actor"]
        if mine[0] * mine[1] != actor[0] * actor[1]:
            raise ConfigError(f"--resource {role} {mine} must have as many workers as actor {actor} ({why}); make "
                              f"them equal or drop the {role} entry")


def check_critic(v: dict, explicit) -> None:
    ppo = v.get("advantage_estimator") == "ppo"
    if not ppo:
        for dest in ("critic_lr", "critic_load", "critic_save"):
            # a resolved config (--dry-run) restates the derived values: not a user choice
            derived = {"critic_lr": v.get("lr"), "critic_load": v.get("load")}.get(dest)
            if dest in explicit and v.get(dest) is not None and v.get(dest) != derived:
                raise ConfigError(f"--{dest.replace('_', '-')} configures the critic, which only "
                                  "--advantage-estimator ppo has; use ppo or drop the flag")
        for dest in ("critic_lr_warmup_iters", "value_clip", "lambd"):
            if dest in explicit and v.get(dest) != {"critic_lr_warmup_iters": 0, "value_clip": 0.2,
                                                    "lambd": 1.0}[dest]:
                raise ConfigError(f"--{dest.replace('_', '-')} is used by the critic / GAE of --advantage-estimator "
                                  "ppo only; use ppo or drop the flag")
    if ppo:
        _same_workers(v, "critic", "the critic uses the actor's parallel layout")
        if v.get("loss_type") not in (None, "policy_loss"):
            raise ConfigError(f"--advantage-estimator ppo trains the actor with the policy loss; --loss-type "
                              f"{v.get('loss_type')} does not use its advantages (drop one of them)")


def check_opd(v: dict, explicit) -> None:
    if not v.get("use_opd"):
        for dest in ("opd_teacher_load", "opd_teacher_ckpt_step"):
            if dest in explicit and v.get(dest) is not None:
                raise ConfigError(f"--{dest.replace('_', '-')} has no effect without --use-opd; add --use-opd "
                                  "--opd-type megatron or drop it")
        if "opd_kl_coef" in explicit and v.get("opd_kl_coef") != 1.0:
            raise ConfigError("--opd-kl-coef has no effect without --use-opd; add --use-opd or drop it")
        return
    if v.get("opd_teacher_ckpt_step") is not None and not v.get("opd_teacher_load"):
        raise ConfigError("--opd-teacher-ckpt-step picks an iteration of --opd-teacher-load; add --opd-teacher-load")
    if v.get("opd_type") == "sglang" and v.get("opd_teacher_load"):
        raise ConfigError("--opd-teacher-load is the Megatron teacher's checkpoint; use --opd-type megatron")
    if v.get("opd_type") == "megatron":
        _same_workers(v, "teacher", "the teacher uses the actor's parallel layout")


def check_train_data(v: dict, explicit) -> None:
    if v.get("advantage_estimator") == "on_policy_distillation" and not v.get("use_opd"):
        raise ConfigError("--advantage-estimator on_policy_distillation trains only on the teacher's OPD term; add "
                          "--use-opd --opd-type megatron --opd-teacher-load PATH, or pick another estimator")
    convert = v.get("custom_convert_samples_to_train_data_path")
    if v.get("custom_reward_post_process_path") and convert:
        raise ConfigError("--custom-convert-samples-to-train-data-path returns the post-processed rewards itself; "
                          "drop --custom-reward-post-process-path (or do its work in the convert function)")
    if not v.get("disable_compute_advantages_and_returns"):
        return
    for dest, why in (("custom_reward_post_process_path", "post-processes rewards for the advantages"),
                      ("kl_coef", "shapes the rewards of the advantages"),
                      ("use_opd", "adds the teacher's term to the advantages")):
        if v.get(dest):
            raise ConfigError(f"--{dest.replace('_', '-')} {why}, which --disable-compute-advantages-and-returns "
                              "skips; drop one of them")
    if v.get("advantage_estimator") == "ppo":
        raise ConfigError("--advantage-estimator ppo needs the GAE advantages and returns that "
                          "--disable-compute-advantages-and-returns skips; drop one of them")
    if v.get("loss_type") in (None, "policy_loss") and not convert:
        raise ConfigError("--disable-compute-advantages-and-returns leaves every advantage 0, so the policy loss has "
                          "no gradient; use --loss-type sft / custom_loss, or give "
                          "--custom-convert-samples-to-train-data-path returning 'advantages'")


def check_old_policy(v: dict, explicit) -> None:
    if v.get("keep_old_actor") and v.get("use_rollout_logprobs"):
        raise ConfigError("--keep-old-actor recomputes old log-probs with the rollout policy's weights, which "
                          "--use-rollout-logprobs replaces by the engine's; drop one of them")
    if not v.get("true_on_policy_mode"):
        return
    if v.get("use_tis") or v.get("use_opsm"):
        raise ConfigError("--true-on-policy-mode trains on the engine's log-probs and checks that the trainer's "
                          "match them, so --use-tis / --use-opsm have nothing to correct; drop them")
    if (v.get("update_weights_interval") or 1) > 1 and not v.get("keep_old_actor"):
        raise ConfigError("--true-on-policy-mode with --update-weights-interval > 1: the engines roll out with "
                          "older weights than the trainer's; add --keep-old-actor so the check uses them")


# MoE routing replay --------------------------------------------------------------------------------------------
def _hf_num_experts(path) -> int | None:
    """Experts per MoE layer from `<path>/config.json` (0 for a dense model), None when it cannot be read."""
    cfg = read_hf_config(path)
    if cfg is None:
        return None
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)


def check_routing_replay(v: dict, explicit) -> None:
    if not (v.get("use_routing_replay") or v.get("use_rollout_routing_replay")):  # the latter implies the former
        return
    name = "--use-rollout-routing-replay" if v.get("use_rollout_routing_replay") else "--use-routing-replay"
    if v.get("sequence_parallel") and (v.get("tensor_model_parallel_size") or 1) > 1:
        raise ConfigError(f"{name} with --sequence-parallel is not supported yet; drop one of them")
    if v.get("num_experts"):
        return
    experts = _hf_num_experts(v["hf_checkpoint"]) if v.get("hf_checkpoint") else None
    if experts == 0 or (experts is None and not v.get("hf_checkpoint")):
        raise ConfigError(f"{name} replays MoE routing, but the model is dense (--hf-checkpoint "
                          f"{v.get('hf_checkpoint')} has no experts); use an MoE model or drop {name}")


def check_opd_sglang(v: dict, explicit) -> None:
    if not (v.get("use_opd") and v.get("opd_type") == "sglang"):
        return
    if not v.get("rm_url"):
        raise ConfigError("--opd-type sglang takes the teacher's log-probs from the SGLang-API server at --rm-url; "
                          "add --rm-url http://HOST:PORT (or use --opd-type megatron --opd-teacher-load PATH)")
    if v.get("rm_type") == "remote_rm":
        raise ConfigError("--opd-type sglang uses --rm-url as the teacher server, so --rm-type remote_rm would send "
                          "rewards there too; pick another --rm-type or --opd-type megatron")


def check_sequence_parallel(v: dict, explicit) -> None:
    """--sequence-parallel splits the sequence over the tensor-parallel ranks; as in Megatron it does nothing
    without tensor parallelism (the trainer then runs without it)."""
    if not v.get("sequence_parallel") or (v.get("tensor_model_parallel_size") or 1) == 1:
        return
    if v.get("advantage_estimator") == "ppo":
        raise ConfigError("--sequence-parallel with --advantage-estimator ppo: the critic's value head is not built "
                          "for sequence parallelism yet; drop --sequence-parallel or use another estimator")


def check_expert_parallel(v: dict, explicit) -> None:
    """--expert-model-parallel-size splits each MoE layer's experts over ranks, --expert-tensor-parallel-size
    splits each expert's matrices: the model needs experts, a count the split divides, and trainer ranks that
    hold whole expert groups at every pipeline stage (Megatron's expert-data-parallel layout: ranks /
    (expert-tensor x expert x pipeline parallel)). Megatron refuses an MoE model under tensor parallelism
    without sequence parallelism (its TransformerConfig raises when the trainer builds); said here first."""
    ep = v.get("expert_model_parallel_size") or 1
    etp = v.get("expert_tensor_parallel_size") or 1
    tp = v.get("tensor_model_parallel_size") or 1
    if ep == 1 and etp == 1 and tp == 1:
        return
    experts = v.get("num_experts") or (_hf_num_experts(v["hf_checkpoint"]) if v.get("hf_checkpoint") else None)
    if experts is None:  # no readable model here (a launch script's --dry-run on another machine): checked at start
        return
    if experts and tp > 1 and not v.get("sequence_parallel"):
        raise ConfigError(f"--tensor-model-parallel-size {tp} with an MoE model ({experts} experts) needs "
                          "--sequence-parallel (Megatron-core requires it for MoE layers under tensor parallelism)")
    if ep == 1 and etp == 1:
        return
    if etp not in (1, tp):
        raise ConfigError(f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size {tp}: the trainer is "
                          f"built and checked for experts split like the dense layers ({tp}) or held whole (1); use "
                          "one of those")
    if experts == 0 and ep == 1:
        raise ConfigError(f"--expert-tensor-parallel-size {etp} splits experts, but the model is dense "
                          f"(--hf-checkpoint {v.get('hf_checkpoint')} has no experts); use 1 or an MoE model")
    if experts == 0:
        raise ConfigError(f"--expert-model-parallel-size {ep} splits experts, but the model is dense "
                          f"(--hf-checkpoint {v.get('hf_checkpoint')} has no experts); use 1 or an MoE model")
    if experts % ep:
        raise ConfigError(f"--expert-model-parallel-size {ep} must divide the model's {experts} experts")
    replicas, gpus = (v.get("resource") or {}).get("actor", [1, 1])  # the default: one trainer rank
    block = etp * ep * (v.get("pipeline_model_parallel_size") or 1)
    if (replicas * gpus) % block:
        raise ConfigError(f"--resource actor has {replicas * gpus} trainer ranks, not divisible by "
                          f"--expert-tensor-parallel-size x --expert-model-parallel-size x "
                          f"--pipeline-model-parallel-size = {block}")


def check_context_parallel(v: dict, explicit) -> None:
    """--context-parallel-size splits every sequence over ranks (relax.backends.megatron.context_parallel): built
    and checked for dense models without pipeline parallelism."""
    cp = v.get("context_parallel_size") or 1
    if cp == 1:
        return
    if (v.get("pipeline_model_parallel_size") or 1) > 1:
        raise ConfigError(f"--context-parallel-size {cp} with --pipeline-model-parallel-size "
                          f"{v['pipeline_model_parallel_size']} is not supported yet; use one of them")
    experts = v.get("num_experts") or (_hf_num_experts(v["hf_checkpoint"]) if v.get("hf_checkpoint") else None)
    if experts:
        raise ConfigError(f"--context-parallel-size {cp} with an MoE model ({experts} experts) is not supported "
                          "yet; context parallelism is built for dense models")


def check_exit_on_missing_checkpoint(v: dict, explicit) -> None:
    """--exit-on-missing-checkpoint: with --load naming no checkpoint (no marker file), stop instead of starting from
    the initial weights, as Megatron-LM does; before Ray."""
    load = v.get("load")
    # with --pretrained-checkpoint an empty --load is expected: the weights come from there (relax.core.preflight)
    if v.get("exit_on_missing_checkpoint") and load and not v.get("pretrained_checkpoint") \
            and latest_iteration(load) is None:
        raise ConfigError(f"--load {load} holds no checkpoint ({MARKER} is missing) and --exit-on-missing-checkpoint "
                          "says to stop rather than start from the initial weights")


# --use-health-check's own flags, with their parser defaults (relax/config/flags/fault.py)
_HEALTH_FLAGS = {"max_global_restart": ("--max-global-restart", 3), "heartbeat_interval": ("--heartbeat-interval", 1.0),
                 "heartbeat_timeout": ("--heartbeat-timeout", 30.0)}


def heartbeat_error(interval, timeout) -> Optional[str]:
    """Why a heartbeat period and timeout cannot work, None when they can. The timeout must be at least twice the
    period: a single late beat (a busy process, a slow poll of the board) must not fail a healthy worker.
    Also the HealthManager's own guard (relax.core.health), for a config built without parse_config."""
    for name, value in (("--heartbeat-interval", interval), ("--heartbeat-timeout", timeout)):
        if value is None or not math.isfinite(value) or value <= 0:
            return f"{name} must be a finite number of seconds > 0, got {value}"
    if timeout < 2 * interval:
        return (f"--heartbeat-timeout {timeout:g} must be at least twice --heartbeat-interval {interval:g}, so that "
                f"one late heartbeat does not fail a healthy worker: raise --heartbeat-timeout to {2 * interval:g} "
                f"or more, or lower --heartbeat-interval to {timeout / 2:g} or less")
    return None


def check_health(v: dict, explicit) -> None:
    """--use-health-check and its flags, before Ray: otherwise a bad heartbeat setting only fails once the
    HealthManager starts (exit 1, after Ray and the placement groups). No checkpoint directory is required: a
    restart without one starts from step 0 (relax.core.health_restart), which the log says."""
    if not v.get("use_health_check"):
        for dest, (name, default) in _HEALTH_FLAGS.items():
            if dest in explicit and v.get(dest) != default:
                raise ConfigError(f"{name} configures the HealthManager of --use-health-check: add "
                                  f"--use-health-check (or drop {name})")
        return
    error = heartbeat_error(v.get("heartbeat_interval"), v.get("heartbeat_timeout"))
    if error:
        raise ConfigError(error)


RULES: tuple = (check_reference, check_corrections, check_critic, check_opd, check_train_data, check_old_policy,
                 check_routing_replay, check_opd_sglang, check_sequence_parallel, check_expert_parallel,
                 check_context_parallel, check_exit_on_missing_checkpoint, check_health) + rules_checkpoint.RULES \
    + rules_ddp.RULES + rules_lora.RULES
