"""docs/configuration.md is generated from the parser; fail when it is stale."""

import subprocess
import sys

from conftest import ROOT


def test_configuration_doc_is_current():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_env_layers(tmp_path):
    from relax.config.env import worker_env

    env_yaml = tmp_path / "env.yaml"
    env_yaml.write_text("env_vars:\n  NCCL_DEBUG: INFO\n  OMP_NUM_THREADS: '2'\n")
    env = worker_env({"NCCL_DEBUG": "TRACE"}, training_role=True, env_yaml=env_yaml)
    assert env["NCCL_DEBUG"] == "TRACE" and env["OMP_NUM_THREADS"] == "2" and env["TQ_NUM_THREADS"] == "1"
    env = worker_env({"NCCL_DEBUG": "TRACE"}, training_role=False, env_yaml=env_yaml)
    assert env["NCCL_DEBUG"] == "INFO"
