"""Parse-time errors: one clear message naming the flag, exit code 2, never a traceback."""

import pytest

from conftest import relax_cli
from relax.config import ConfigError, parse_config
from relax.config.support import no_effect_flags, unsupported_flags


def err(argv):
    with pytest.raises(ConfigError) as info:
        parse_config(argv)
    return str(info.value)


BASE = ["--output-dir", "/tmp/relax-test-cfg"]


@pytest.mark.parametrize("argv, needles", [
    (["--kl-coef", "0.1", "--kl-loss-coef", "0.1", "--use-kl-loss"], ["--kl-coef", "--kl-loss-coef"]),
    (["--rotate-ckpt"], ["--rotate-ckpt", "--save", "--async-save"]),
    (["--fully-async", "--colocate"], ["--colocate", "--fully-async"]),
    (["--balance-data"], ["--balance-data", "--colocate"]),
    (["--rollout-batch-size", "8", "--over-sampling-batch-size", "4"], ["--over-sampling-batch-size", "--rollout-batch-size"]),
    (["--use-dynamic-batch-size"], ["--use-dynamic-batch-size", "--max-tokens-per-gpu"]),
    (["--loss-type", "custom_loss"], ["--custom-loss-function-path"]),
    (["--use-opd"], ["--use-opd", "--opd-type"]),
    (["--use-opd", "--opd-type", "megatron"], ["--opd-teacher-load"]),
    (["--only-train-params-name-list", "a", "--freeze-params-name-list", "b"], ["--only-train-params-name-list", "--freeze-params-name-list"]),
    (["--get-mismatch-metrics"], ["--custom-tis-function-path"]),
    (["--advantage-estimator", "reinforce_plus_plus"], ["--normalize-advantages"]),
    (["--rollout-temperature", "0"], ["--rollout-temperature"]),
    (["--rollout-temperature", "nan"], ["--rollout-temperature"]),
    (["--rollout-top-p", "1.5"], ["--rollout-top-p"]),
    (["--rollout-top-p", "0"], ["--rollout-top-p"]),
    (["--rollout-top-k", "0"], ["--rollout-top-k"]),
    (["--eval-temperature", "-1"], ["--eval-temperature"]),
    (["--resource", '{"actor": [1, 8'], ["--resource", "invalid JSON", '{"actor": [1, 8']),
    (["--resource", '{"actr": [1, 8]}'], ["--resource", "actr"]),
    (["--apply-chat-template-kwargs", "[1]"], ["--apply-chat-template-kwargs"]),
    (["--train-env-vars", "{bad"], ["--train-env-vars", "{bad"]),
    (["--genrm-engine-config", "nope"], ["--genrm-engine-config"]),
    (["--multimodal-keys", "{'a': 1}"], ["--multimodal-keys"]),
    (["--custom-rm-path", "no_such_module_xyz.fn"], ["--custom-rm-path", "no_such_module_xyz"]),
    (["--custom-rm-path", "os.path.no_such_fn"], ["--custom-rm-path", "no_such_fn"]),
    (["--rollout-batch-szie", "3"], ["--rollout-batch-szie", "did you mean --rollout-batch-size"]),
    (["--sglang-tp-size", "2"], ["--sglang-tp-size", "--rollout-num-gpus-per-engine"]),
    (["--n-samples-per-prompt", "0"], ["--n-samples-per-prompt"]),
    (["--prompt-data", "/nonexistent/file.jsonl", "--rollout-batch-size", "2", "--num-rollout", "1"], ["--prompt-data", "not found"]),
    (["--max-staleness", "2"], ["--max-staleness", "--fully-async"]),
    (["--eps-clip-c", "0.5"], ["--eps-clip-c"]),
    (["--partial-rollout-max-aborted-count", "2"], ["--partial-rollout"]),
    (["--rollout-external"], ["--rollout-external-engine-addrs"]),
    (["--debug-rollout-only", "--debug-train-only"], ["--debug-rollout-only"]),
    (["--fp16", "--bf16"], ["--fp16", "--bf16"]),
    (["--tensor-model-parallel-size", "3", "--resource", '{"actor": [1, 4], "rollout": [1, 1]}'], ["tensor", "--resource"]),
    (["--rollout-num-gpus-per-engine", "3", "--resource", '{"actor": [1, 1], "rollout": [1, 4]}'], ["--rollout-num-gpus-per-engine"]),
    (["--num-steps-per-rollout", "3"], ["--num-steps-per-rollout"]),
    (["--eval-prompt-data", "a"], ["--eval-prompt-data"]),
    (["--update-weight-buffer-size", "12XB"], ["--update-weight-buffer-size"]),
    (["--kl-loss-type", "k9"], ["--kl-loss-type"]),
    (["--lr", "abc"], ["--lr"]),
])
def test_bad_input_names_the_flag(argv, needles):
    message = err(BASE + argv)
    for needle in needles:
        assert needle in message, message


def test_cli_exit_code_and_single_line():
    proc = relax_cli("--kl-coef", "0.1", "--kl-loss-coef", "0.2", "--use-kl-loss", "--dry-run")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "--kl-coef" in proc.stderr


def test_derived_values_computed_once(prompt_file):
    cfg = parse_config(BASE + ["--prompt-data", prompt_file, "--rollout-batch-size", "2", "--num-epoch", "3",
                               "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2", "--eps-clip", "0.3",
                               "--lr", "2e-5", "--colocate", "--max-tokens-per-gpu", "100",
                               "--rollout-temperature", "0.7"])
    assert cfg.eps_clip_high == 0.3
    assert cfg.critic_lr == 2e-5
    assert cfg.num_rollout == 3  # 3 epochs x 2 prompts / 2 per step
    assert cfg.global_batch_size == 4  # 2 prompts x 4 samples / 2 steps
    assert cfg.offload_train is True and cfg.offload_rollout is True
    assert cfg.log_probs_max_tokens_per_gpu == 100
    assert cfg.eval_temperature == 0.7
    assert cfg.over_sampling_batch_size == 2


def test_config_is_immutable():
    cfg = parse_config(BASE)
    with pytest.raises(AttributeError):
        cfg.lr = 1.0
    with pytest.raises(TypeError):
        cfg["lr"] = 1.0  # type: ignore[index]
    import pickle

    again = pickle.loads(pickle.dumps(cfg))
    assert again.to_dict() == cfg.to_dict() and again.explicit == cfg.explicit


def test_megatron_and_relax_defaults():
    cfg = parse_config(BASE + ["--hf-checkpoint", "/m", "--prompt-data", __file__, "--rollout-batch-size", "1",
                               "--num-rollout", "1"])
    assert cfg.lr == 1e-6 and cfg.micro_batch_size == 1 and cfg.seed == 1234 and cfg.clip_grad == 1.0
    assert cfg.distributed_backend == "nccl" and cfg.distributed_timeout_minutes == 10


def test_sglang_passthrough_and_typed():
    cfg = parse_config(BASE + ["--sglang-mem-fraction-static", "0.7", "--sglang-some-new-flag", "x",
                               "--sglang-enable-foo", "--sglang-cuda-graph-bs", "1", "2", "4"])
    assert cfg.sglang_mem_fraction_static == 0.7
    assert cfg.sglang_some_new_flag == "x"
    assert cfg.sglang_enable_foo is True
    assert cfg.sglang_cuda_graph_bs == [1, 2, 4]
    flagged = unsupported_flags(cfg)
    # the embedded engine would ignore SGLang server flags: one that could change the samples is refused, naming
    # the backend that honours it; one that only sizes or speeds up SGLang servers is accepted with a warning
    assert any(f.startswith("--sglang-some-new-flag (an SGLang server flag") for f in flagged), flagged
    assert not any(f.startswith(("--sglang-mem-fraction-static", "--sglang-cuda-graph-bs")) for f in flagged)
    assert no_effect_flags(cfg) == ["--sglang-cuda-graph-bs", "--sglang-mem-fraction-static"]


def test_sglang_resource_flags_warn_on_the_embedded_engine(tmp_path, prompt_file):
    # a missing model folder stops the run before Ray, after the warning
    proc = relax_cli("--sglang-mem-fraction-static", "0.7", "--hf-checkpoint", str(tmp_path / "no-model"),
                     "--prompt-data", prompt_file, "--rollout-batch-size", "1", "--num-rollout", "1",
                     "--output-dir", str(tmp_path))
    assert "relax-train: warning: --sglang-mem-fraction-static: no effect with the embedded engine" in proc.stderr
    proc = relax_cli("--dry-run", "--sglang-mem-fraction-static", "0.7", "--output-dir", str(tmp_path))
    assert proc.returncode == 0 and "accepted, --sglang-mem-fraction-static: no effect" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "every flag you set is supported"


def test_sglang_server_flags_are_honoured_with_sglang_engines():
    argv = BASE + ["--sglang-mem-fraction-static", "0.7", "--sglang-some-new-flag", "x"]
    cfg = parse_config(argv + ["--rollout-backend", "sglang"])
    assert unsupported_flags(cfg) == []
    from relax.roles.rollout import engine_server_args

    args = engine_server_args(cfg, "sglang")  # what every SGLang server is launched with
    assert args["mem_fraction_static"] == 0.7 and args["some_new_flag"] == "x"


def test_unsupported_flags_stop_a_real_run_before_ray():
    proc = relax_cli("--train-memory-margin-bytes", "3", "--output-dir", "/tmp/relax-test-cfg")
    assert proc.returncode == 2
    assert "not supported yet: --train-memory-margin-bytes" in proc.stderr
    proc = relax_cli("--train-memory-margin-bytes", "3", "--dry-run", "--output-dir", "/tmp/relax-test-cfg")
    assert proc.returncode == 0 and "--train-memory-margin-bytes" in proc.stdout.splitlines()[-1]


def test_num_epoch_counts_usable_rows_as_training_reads_them(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"input": "a"}\n\n{"input": "b"}\n{not json\n{"input": "c"}\n')
    argv = BASE + ["--prompt-data", str(data), "--rollout-batch-size", "2", "--num-epoch", "2"]
    assert parse_config(argv + ["--skip-bad-lines"]).num_rollout == 3  # 2 epochs x 3 usable rows / 2 per step
    with pytest.raises(ConfigError, match=r"p.jsonl:4: malformed JSON.*--skip-bad-lines"):
        parse_config(argv)


def test_derived_facts_are_stored_once():
    cfg = parse_config(BASE + ["--resource", '{"actor": [2, 2], "rollout": [1, 4]}', "--tensor-model-parallel-size",
                               "2", "--rollout-num-gpus-per-engine", "2", "--rollout-backend", "embedded",
                               "--micro-batch-size", "1"])
    assert (cfg.actor_world_size, cfg.data_parallel_size, cfg.num_engines) == (4, 2, 2)
    assert "num_engines" not in cfg and "num_engines" not in cfg.to_dict()  # not a flag: not in the resolved file
    external = parse_config(BASE + ["--rollout-external", "--rollout-external-engine-addrs", "h:1", "h:2", "h:3"])
    assert external.num_engines == 3
    assert parse_config(BASE).rollout_backend in ("embedded", "sglang")  # `auto` is resolved here, once
