"""Parse-time rules of Megatron-LM's checkpoint and run-control flags that Relax builds (relax.core.checkpointing,
relax.core.run_control): functions (values, explicit) -> None raising ConfigError, run by relax.config.validate
through relax.config.rules_training.RULES. What needs the checkpoint files themselves (does --ckpt-step's
iteration exist, is --pretrained-checkpoint a model) is checked before Ray by relax.core.preflight."""

from __future__ import annotations

import enum

from relax.config.errors import ConfigError

# Signals a process cannot catch: --exit-signal-handler could never see them.
_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}


def signal_name(value) -> str:
    """--exit-signal's value as a signal name: Megatron's parser gives an enum, a config file a string."""
    return value.name if isinstance(value, enum.Enum) else str(value)


def check_checkpoint_contents(v: dict, explicit) -> None:
    source = v.get("load") or v.get("pretrained_checkpoint")
    step = v.get("ckpt_step")
    if step is not None:
        if not source:
            raise ConfigError("--ckpt-step picks an iteration of the checkpoint that is loaded; add --load (or "
                              "--pretrained-checkpoint) or drop --ckpt-step")
        if step < 0:
            raise ConfigError(f"--ckpt-step {step}: an iteration is a rollout step count, 0 or more")
    if v.get("finetune") and not source:
        raise ConfigError("--finetune loads the weights of --load (or --pretrained-checkpoint) without the rest of "
                          "its state; add one of them or drop --finetune")
    retain = v.get("save_retain_interval")
    if retain is not None:
        if retain <= 0:
            raise ConfigError(f"--save-retain-interval {retain} must be a number of rollout steps > 0")
        if not v.get("save"):
            raise ConfigError("--save-retain-interval keeps every checkpoint whose step is a multiple of it among "
                              "those --save writes; add --save (and --save-interval) or drop it")


def check_run_control(v: dict, explicit) -> None:
    minutes = v.get("exit_duration_in_mins")
    if minutes is not None and minutes < 0:
        raise ConfigError(f"--exit-duration-in-mins {minutes} must be a number of minutes > 0 (0 or unset: no limit)")
    name = signal_name(v.get("exit_signal") or "SIGTERM")
    if "exit_signal" in explicit and name != "SIGTERM" and not v.get("exit_signal_handler"):
        raise ConfigError(f"--exit-signal {name} names the signal --exit-signal-handler waits for; add "
                          "--exit-signal-handler or drop --exit-signal")
    if v.get("exit_signal_handler") and name in _UNCATCHABLE:
        raise ConfigError(f"--exit-signal {name} cannot be caught by a process; use SIGTERM (the default), SIGINT, "
                          "SIGUSR1 or SIGUSR2")
    skip = list(v.get("iterations_to_skip") or [])
    bad = [i for i in skip if i < 1]
    if bad:
        raise ConfigError(f"--iterations-to-skip {' '.join(map(str, bad))}: iterations are 1-indexed (rollout step "
                          "S is iteration S + 1), so each must be 1 or more")
    if v.get("fully_async"):
        used = [flag for flag, on in (("--exit-duration-in-mins", minutes), ("--exit-signal-handler",
                                      v.get("exit_signal_handler")), ("--iterations-to-skip", skip)) if on]
        if used:
            raise ConfigError(f"{', '.join(used)} with --fully-async is not supported yet (the synchronous loop "
                              "honours them); drop --fully-async or these flags")


RULES: tuple = (check_checkpoint_contents, check_run_control)
