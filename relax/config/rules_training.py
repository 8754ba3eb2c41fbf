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


RULES: tuple = (check_reference, check_corrections)
