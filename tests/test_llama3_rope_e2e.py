"""The Llama-3.1-8B-Instruct model flag file (examples/launch/models/llama3.1-8B-Instruct.sh), unchanged in its RoPE
flags (--rotary-base 500000 --use-rope-scaling --rotary-scaling-factor 8.0, 131072 positions), runs one step of the
colocated launch script on CPU, scaled down: only the sizes are overridden, to a tiny Llama 3.1 built locally (HF
rope_scaling of rope_type llama3, factor 8, Llama 3.1's other parameters), one trainer rank and one engine, whose
log-probs of the sampled tokens the trainer's must equal (--true-on-policy-mode)."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT

pytestmark = pytest.mark.e2e  # a whole run in its own process: Ray, trainer, reference, engine

LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# the flag file's sizes, scaled down to the tiny model's (relax.models.tiny.TinyArch)
TINY_SIZES = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4",
              "--num-query-groups", "2", "--kv-channels", "16", "--vocab-size", "320"]


def _tiny_llama31(path):
    from relax.models.tiny import TinyArch, build_tiny_model_dir

    path = build_tiny_model_dir(path, TinyArch(family="llama", rope_theta=500000.0, rms_norm_eps=1e-5,
                                               max_position_embeddings=131072), seed=0)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = dict(LLAMA31_ROPE)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def test_the_llama31_flag_file_runs_scaled_down(tmp_path):
    model = _tiny_llama31(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input": f"{a}+{b}=", "label": str(a + b)}) + "\n"
                            for a, b in ((1, 1), (2, 3), (4, 4), (5, 2))))
    env = dict(os.environ, MODEL="llama3.1-8B-Instruct", DATA=str(data),
               RELAX_TRAIN=f"{sys.executable} -m relax.entrypoints.train")
    flags = ["--hf-checkpoint", str(model), "--ref-load", str(model), "--load", str(tmp_path / "ckpt"),
             "--save", str(tmp_path / "ckpt"), "--input-key", "input", "--rm-type", "exact_match",
             "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
             "--global-batch-size", "4", "--rollout-max-response-len", "8", "--tensor-model-parallel-size", "1",
             "--resource", '{"actor": [1, 1], "rollout": [1, 1]}', "--rollout-num-gpus-per-engine", "1",
             "--tb-project-name", str(tmp_path / "tensorboard"), "--distributed-backend", "gloo",
             "--output-dir", str(tmp_path / "run"), "--true-on-policy-mode", *TINY_SIZES]
    proc = subprocess.run(["bash", str(ROOT / "examples" / "launch" / "run-grpo-colocate.sh"), *flags],
                          capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert "not supported yet" not in console
    assert "--rotary-scaling-factor has no effect: Megatron reads it only for multi-latent attention" in console
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0] and records[0]["samples/trained"] == 4
    # the trainer's log-probs of the sampled tokens are the engine's (--true-on-policy-mode compares them)
    assert records[0]["train/true_on_policy_max_abs_diff"] < 1e-4, records[0]
    config = yaml.safe_load((tmp_path / "run" / "resolved_config.yaml").read_text())
    assert (config["use_rope_scaling"], config["rotary_scaling_factor"], config["rotary_base"]) == (True, 8.0, 500000)
