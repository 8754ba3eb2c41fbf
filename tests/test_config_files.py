"""--custom-config-path: YAML/TOML, interpolation, precedence, unknown keys, merged before validation."""

import pytest

from relax.config import ConfigError, parse_config

BASE = ["--output-dir", "/tmp/relax-test-files"]


def test_yaml_toml_compose_and_cli_wins(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("rollout-batch-size: 4\nn_samples_per_prompt: 2\nlr: 1.0e-5\n")
    b = tmp_path / "b.toml"
    b.write_text('lr = 3e-5\nrollout_temperature = 0.5\nsglang_mem_fraction_static = 0.6\n')
    cfg = parse_config(BASE + ["--custom-config-path", str(a), "--custom-config-path", str(b),
                               "--rollout-temperature", "0.9"])
    assert cfg.rollout_batch_size == 4 and cfg.n_samples_per_prompt == 2
    assert cfg.lr == 3e-5  # later file wins over earlier
    assert cfg.rollout_temperature == 0.9  # command line wins over files
    assert cfg.sglang_mem_fraction_static == 0.6
    assert {"lr", "rollout_batch_size"} <= cfg.explicit


def test_interpolation_and_resolvers_see_command_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("global_batch_size: ${mul:${rollout_batch_size},${n_samples_per_prompt}}\n"
                 "max_tokens_per_gpu: ${idiv:${rollout_max_response_len},2}\n"
                 "rollout_max_response_len: 64\n")
    cfg = parse_config(BASE + ["--custom-config-path", str(f), "--rollout-batch-size", "3",
                               "--n-samples-per-prompt", "5"])
    assert cfg.global_batch_size == 15 and isinstance(cfg.global_batch_size, int)
    assert cfg.max_tokens_per_gpu == 32


def test_unknown_key_names_file_and_suggests(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("rollout_bach_size: 3\n")
    with pytest.raises(ConfigError) as info:
        parse_config(BASE + ["--custom-config-path", str(f)])
    msg = str(info.value)
    assert str(f) in msg and "rollout_bach_size" in msg and "--rollout-batch-size" in msg


def test_file_values_are_validated(tmp_path):
    f = tmp_path / "v.yaml"
    f.write_text("kl_coef: 0.1\nkl_loss_coef: 0.1\nuse_kl_loss: true\n")
    with pytest.raises(ConfigError, match="--kl-coef"):
        parse_config(BASE + ["--custom-config-path", str(f)])
    g = tmp_path / "t.yaml"
    g.write_text("rollout_top_p: 2.0\n")
    with pytest.raises(ConfigError, match="--rollout-top-p"):
        parse_config(BASE + ["--custom-config-path", str(g)])
    h = tmp_path / "w.yaml"
    h.write_text("rollout_batch_size: many\n")
    with pytest.raises(ConfigError, match="rollout_batch_size"):
        parse_config(BASE + ["--custom-config-path", str(h)])
    s = tmp_path / "s.yaml"
    s.write_text("colocate: 3\n")
    with pytest.raises(ConfigError, match="--colocate"):
        parse_config(BASE + ["--custom-config-path", str(s)])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        parse_config(BASE + ["--custom-config-path", str(tmp_path / "nope.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        parse_config(BASE + ["--custom-config-path", str(bad)])
