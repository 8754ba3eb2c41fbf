"""--dry-run writes a resolved config that reproduces itself, and explains the batch arithmetic."""

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, relax_cli
from relax.config import parse_config


def test_dry_run_explains_and_roundtrips(tmp_path, prompt_file):
    out = tmp_path / "run"
    args = ["--dry-run", "--output-dir", str(out), "--hf-checkpoint", "/models/x", "--prompt-data", prompt_file,
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2",
            "--num-rollout", "5", "--resource", '{"actor": [1, 4], "rollout": [1, 2]}',
            "--tensor-model-parallel-size", "2", "--micro-batch-size", "1", "--sglang-mem-fraction-static", "0.5"]
    proc = relax_cli(*args)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "2 prompts x 4 samples per prompt = 8 samples" in text
    assert "tensor 2 x pipeline 1 x context 1 x data-parallel 2" in text
    assert "2 step(s) per rollout, global batch 4 samples" in text
    assert "rollout engines: 2" in text
    resolved = out / "resolved_config.yaml"
    first = yaml.safe_load(resolved.read_text())
    cfg1 = parse_config([a for a in args if a != "--dry-run"])
    cfg2 = parse_config(["--custom-config-path", str(resolved), "--output-dir", str(out)])
    skip = {"custom_config_path", "dry_run"}
    assert {k: v for k, v in cfg1.items() if k not in skip} == {k: v for k, v in cfg2.items() if k not in skip}
    assert sorted(cfg1.explicit) != [] and set(cfg2.explicit) >= set(cfg1.explicit) - {"dry_run"}
    proc2 = relax_cli("--dry-run", "--custom-config-path", str(resolved), "--output-dir", str(out))
    assert proc2.returncode == 0, proc2.stderr
    assert yaml.safe_load(resolved.read_text()) == first
    # the same unsupported-flag verdict after the round trip
    assert proc.stdout.splitlines()[-1] == proc2.stdout.splitlines()[-1]


def test_embedded_default_dry_run(tmp_path):
    proc = relax_cli("--dry-run", "--output-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "embedded default" in proc.stdout
    assert (tmp_path / "resolved_config.yaml").is_file()


@pytest.mark.parametrize("script", ["run-grpo-colocate.sh", "run-grpo-fully-async.sh"])
@pytest.mark.parametrize("model", ["qwen2.5-7B", "qwen3-4B", "qwen3-30B-A3B", "llama3-8B", "glm4-9B"])
def test_public_style_launch_scripts_pass_dry_run(tmp_path, script, model):
    import sys

    # rows in the scripts' keys (--input-key prompt): --num-epoch counts the rows training can use
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": "4"}\n')
    env = dict(os.environ, MODEL=model, DATA=str(data), RELAX_TRAIN=f"{sys.executable} -m relax.entrypoints.train")
    proc = subprocess.run(["bash", str(ROOT / "examples" / "launch" / script), "--dry-run", "--output-dir",
                           str(tmp_path)], capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "configuration is valid" in proc.stdout


def test_entry_points_are_the_same_program():
    import shutil

    exe = shutil.which("relax-train") or str(Path(os.sys.executable).parent / "relax-train")
    a = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    b = relax_cli("--help")
    assert a.returncode == 0 and b.returncode == 0
    assert a.stdout.replace("relax-train", "X") == b.stdout.replace("relax-train", "X")


@pytest.mark.parametrize("flags, line", [
    ([], "old-policy log-probs: recomputed by the actor forward pass before the first optimizer step"),
    (["--num-steps-per-rollout", "1"], "old-policy log-probs: not needed (one optimizer step per rollout"),
    (["--use-rollout-logprobs"], "old-policy log-probs: the engine's (--use-rollout-logprobs): no actor forward pass"),
    (["--true-on-policy-mode"], "old-policy log-probs: the engine's; the actor forward pass runs too"),
])
def test_dry_run_says_whether_the_actor_forward_pass_runs(tmp_path, flags, line):
    """The embedded default makes 4 optimizer steps per rollout; the same reading decides the trainer's pass
    (relax.config.old_policy, used by relax.training.step._old_logprobs)."""
    from relax.config.explain import explain

    text = explain(parse_config(["--output-dir", str(tmp_path), *flags]))
    assert line in text, text


def test_resource_keys_whose_stage_runs_on_the_actor_are_accepted_with_a_warning(tmp_path):
    """--resource actor_fwd / advantages (the reference's launch scripts set them): those stages run on the
    actor's ranks, so the entries place nothing; the dry run and a real run's start say so."""
    from relax.config.support import resource_warnings

    resource = '{"actor": [1, 1], "rollout": [1, 1], "actor_fwd": [1, 1], "advantages": [1, 1]}'
    proc = relax_cli("--dry-run", "--output-dir", str(tmp_path), "--resource", resource)
    assert proc.returncode == 0, proc.stderr
    assert "accepted, --resource actor_fwd [1, 1]: no effect; the actor's forward pass" in proc.stdout
    assert "accepted, --resource advantages [1, 1]: no effect" in proc.stdout
    config = parse_config(["--output-dir", str(tmp_path), "--resource", '{"actor": [1, 1], "rollout": [1, 1]}'])
    assert resource_warnings(config) == []
