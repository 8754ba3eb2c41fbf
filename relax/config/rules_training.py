"""Cross-flag rules of training features: functions (values, explicit) -> None raising ConfigError.
validate.py runs every function listed in RULES after its own rules."""

RULES: tuple = ()
