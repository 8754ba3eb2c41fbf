"""Secrets are redacted in what a run writes (resolved config, logged command lines)."""

from relax.config import parse_config
from relax.config.explain import resolved_values
from relax.config.redact import REDACTED, redact_command, redact_text, redact_value


def test_resolved_config_hides_train_env_values(tmp_path):
    config = parse_config(["--output-dir", str(tmp_path), "--train-env-vars", '{"HF_TOKEN": "hf_abc123"}', "--dry-run"])
    values = resolved_values(config)
    assert values["train_env_vars"] == {"HF_TOKEN": REDACTED}
    assert "hf_abc123" not in repr(values)


def test_urls_and_named_secrets():
    assert redact_text("https://user:pw123@host/x?token=abc&a=1") == f"https://user:{REDACTED}@host/x?token={REDACTED}&a=1"
    assert redact_value("notify_urls", ["tgram://123:BOTTOKEN/456", "json://localhost:8080"]) == \
        [f"tgram://{REDACTED}", f"json://{REDACTED}"]
    assert redact_value("rm_api_key", "sk-1") == REDACTED
    assert redact_value("rm_url", "http://127.0.0.1:8000/score") == "http://127.0.0.1:8000/score"
    assert redact_command(["router", "--api-key", "s3cret", "--port", "1"]) == ["router", "--api-key", REDACTED,
                                                                                 "--port", "1"]
    assert redact_command(["router", "--api-key=s3cret", "--port", "1"]) == ["router", f"--api-key={REDACTED}",
                                                                               "--port", "1"]


def test_ordinary_flags_are_not_redacted():
    for name in ("moe_token_dispatcher_type", "input_key", "label_key", "max_tokens_per_gpu"):
        assert redact_value(name, "allgather") == "allgather"
    assert redact_value("hf_token", "x") == REDACTED and redact_value("wandb_api_key", "x") == REDACTED
