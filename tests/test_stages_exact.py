"""The synchronous step gives exactly the results it gave before it became a list of stages over data-plane
fields (relax.core.stages): the learning metrics of a few steps, compared with values recorded from the
earlier code (one fused train call, auxiliary results passed through the driver) at the same seeds.

Recorded in tests/data/stages_exact_reference.json by running this file with RELAX_RECORD_STAGES=1 on the
code before the change (one variant per CPU kernel family, tests/recorded_runs.py). Re-recorded (with tests/test_reproducible.py and tests/test_fully_async_e2e.py) when the
trainer's LM head moved to the response rows alone (relax.backends.megatron.response_positions): a float32 matmul
over fewer rows rounds differently, so the train/ metrics moved in their last digits (step 0 of the embedded
default: grad norm 0.87476367 -> 0.87476362, loss -0.01244416 -> -0.01244414) and every rollout metric stayed
identical. Every non-timing metric of every step is compared with ==: rewards, losses, grad
norms, KL, clip fractions, advantages and critic metrics. The stages compute the same float operations in the
same order (per-sample rows go through the data plane as float32, which is what the trainers computed them
in), so no tolerance is needed.

Runs:
* the embedded default (reference + KL loss, 4 updates per step so old log-probs are recomputed): its run is the
  one of tests/test_reproducible.py, made there under CPU load and checked against its record here
  (`embedded_default_seed1234`; the record of seed 7 is kept from the first recording);
* PPO with a critic, --kl-coef reward shaping (non-zero in step 1) and --ref-update-interval 2, with 2
  data-parallel ranks per role.
"""

import pytest
import recorded_runs
from conftest import run_steps, shared_tiny_model

from relax.config import parse_config
from relax.models.tasks import generate_task_dataset

pytestmark = pytest.mark.e2e  # whole runs: Ray, trainer, reference, critic, engines



def _compared(record: dict) -> dict:
    """Every metric that is not a time, a rate or a byte count of the machine's speed."""
    return {k: v for k, v in record.items() if not k.startswith("perf/")}


def _check_or_record(name: str, records: list[dict]) -> None:
    got = [_compared(r) for r in records]
    if recorded_runs.RECORD:
        recorded_runs.record(name, got)
    else:
        recorded_runs.check(name, got)


def test_ppo_critic_kl_reward_exact(tmp_path):
    model = shared_tiny_model()
    data = generate_task_dataset(tmp_path / "train.jsonl", 40, seed=0, task="add_mod10")
    config = parse_config([
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--apply-chat-template", "--input-key", "input",
        "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "4", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2",
        "--resource", '{"actor": [1, 2], "rollout": [1, 1]}', "--num-data-storage-units", "1",
        "--output-dir", str(tmp_path / "out"), "--distributed-backend", "gloo", "--advantage-estimator", "ppo",
        "--num-rollout", "2", "--kl-coef", "0.05", "--ref-update-interval", "2", "--critic-lr", "5e-3",
        "--seed", "3"])
    records = run_steps(config)
    assert all(r["train/num_updates"] == 2 and r["critic/grad_norm"] > 0 for r in records)
    _check_or_record("ppo_critic_kl_reward", records)
