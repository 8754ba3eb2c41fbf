"""Cross-flag rules of training features: functions (values, explicit) -> None raising ConfigError.
validate.py runs every function listed in RULES after its own rules."""

from relax.config.errors import ConfigError


def _needs_reference(v: dict) -> bool:
    return bool(v.get("use_kl_loss")) or bool(v.get("kl_coef"))


def check_reference(v: dict, explicit) -> None:
    if v.get("ref_update_interval") is not None and not _needs_reference(v):
        raise ConfigError("--ref-update-interval has no effect without a reference model; add --use-kl-loss "
                          "or --kl-coef, or drop --ref-update-interval")
    if v.get("use_unbiased_kl") and not v.get("use_kl_loss"):
        raise ConfigError("--use-unbiased-kl weights the KL loss term; add --use-kl-loss or drop --use-unbiased-kl")
    if v.get("ref_ckpt_step") is not None and not v.get("ref_load"):
        raise ConfigError("--ref-ckpt-step picks an iteration of --ref-load; add --ref-load or drop --ref-ckpt-step")
    res = v.get("resource") or {}
    if _needs_reference(v) and res.get("reference") and res.get("actor"):
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


RULES: tuple = (check_reference, check_corrections, check_critic, check_opd)
