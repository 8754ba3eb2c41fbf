"""Expert parallelism at run time: a tiny Qwen3-MoE model trained by 2 trainer ranks with
--expert-model-parallel-size 2 (each rank holds half of every layer's experts) through the controller, with the
engines' weights checked equal to the trainer's full weights after every push (--check-weight-update-equal).
Equality of EP 2 with EP 1 is tests/test_megatron_moe.py's; bad layouts fail before Ray."""

import json

import pytest
from conftest import run_steps

from relax.backends.megatron.testing import build_random_tiny_moe_model
from relax.config import ConfigError, parse_config
from relax.config.support import require_supported
from relax.models.tiny import build_byte_tokenizer


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = build_random_tiny_moe_model(tmp_path_factory.mktemp("ep") / "qwen3moe", seed=7)
    tok = build_byte_tokenizer()
    tok.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    (path / "config.json").write_text(json.dumps(cfg))
    prompts = path.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str((i + 1) % 10)}) + "\n" for i in range(8)))
    return path, prompts


def _argv(moe_dir, out, *extra):
    path, prompts = moe_dir
    return ["--hf-checkpoint", str(path), "--prompt-data", str(prompts), "--input-key", "input",
            "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "3", "--micro-batch-size", "2",
            "--lr", "1e-3", "--lr-decay-style", "constant", "--distributed-backend", "gloo",
            "--num-rollout", "2", "--output-dir", str(out), *extra]


@pytest.mark.e2e
def test_two_steps_with_experts_split_over_two_ranks(moe_dir, tmp_path):
    config = parse_config(_argv(moe_dir, tmp_path / "run", "--expert-model-parallel-size", "2",
                                "--resource", '{"actor": [1, 2], "rollout": [1, 1]}', "--check-weight-update-equal"))
    require_supported(config)
    records = run_steps(config)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["train/grad_norm"] > 0 and r["samples/trained"] == 8 for r in records)
    assert records[-1]["weights/version"] == 2.0


def test_bad_expert_layouts_fail_before_ray(moe_dir, tmp_path, tiny_model):
    with pytest.raises(ConfigError, match="must divide the model's 4 experts"):
        parse_config(_argv(moe_dir, tmp_path, "--expert-model-parallel-size", "3",
                           "--resource", '{"actor": [1, 3], "rollout": [1, 1]}'))
    with pytest.raises(ConfigError, match="not divisible by --expert-tensor-parallel-size"):
        parse_config(_argv(moe_dir, tmp_path, "--expert-model-parallel-size", "2"))
    with pytest.raises(ConfigError, match="the model is dense"):
        parse_config(_argv(moe_dir, tmp_path, "--hf-checkpoint", tiny_model, "--expert-model-parallel-size", "2",
                           "--resource", '{"actor": [1, 2], "rollout": [1, 1]}'))
