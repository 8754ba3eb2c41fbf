"""A two-step run launched the way launch scripts launch it: the model flag file of the tiny model next to
--hf-checkpoint, plus Megatron's vocabulary padding. Actor and reference build their model with `arch_for_run`
(padded to 512 rows), the engines get the 320 real rows, and --ref-update-interval copies the actor's padded
state into the reference."""

import math

import pytest
import ray

from conftest import run_steps, shared_tiny_model
from test_arch_flags import TINY_MODEL_ARGS

from relax.config import parse_config
from relax.config.support import require_supported
from relax.models.tasks import generate_task_dataset

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')


def _vocab_rows(worker) -> tuple[int, int]:
    def rows(self):
        return self.trainer.arch.vocab_size, self.trainer.arch.hf_vocab_size

    return ray.get(worker.__ray_call__.remote(rows))


def test_two_steps_with_a_model_flag_file_and_padded_vocabulary(tmp_path):
    data = generate_task_dataset(tmp_path / "train.jsonl", 8, seed=0, task="add_mod10")
    config = parse_config([
        "--hf-checkpoint", str(shared_tiny_model()), "--prompt-data", str(data), "--apply-chat-template",
        "--input-key", "input", "--label-key", "label", "--rm-type", "random", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--micro-batch-size", "4",
        "--num-rollout", "2", "--use-kl-loss", "--kl-loss-coef", "0.05", "--ref-update-interval", "1",
        "--output-dir", str(tmp_path / "out"), "--distributed-backend", "gloo",
        *TINY_MODEL_ARGS, "--seq-length", "256", "--make-vocab-size-divisible-by", "256",
    ])
    require_supported(config)  # every flag of the model file is honoured
    seen = {}

    def after_start(controller):
        seen["actor"] = _vocab_rows(controller.workers[0])
        seen["reference"] = _vocab_rows(controller.aux.reference.workers[0])

    records = run_steps(config, after_start)
    assert seen == {"actor": (512, 320), "reference": (512, 320)}
    assert len(records) == 2
    for record in records:
        losses = [v for k, v in record.items() if k.startswith("train/") and isinstance(v, float)]
        assert losses and all(math.isfinite(v) for v in losses), record
        # the 192 padding rows take no probability: the entropy of the near-uniform random model stays within the
        # 320 real tokens' bound (ln 512 = 6.24 if they did)
        assert record["train/entropy"] <= math.log(320) + 1e-3, record["train/entropy"]
