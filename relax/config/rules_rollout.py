"""Cross-flag rules of rollout features: functions (values, explicit) -> None raising ConfigError.
validate.py runs every function listed in RULES after its own rules."""

RULES: tuple = ()
