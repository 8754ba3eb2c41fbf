"""The embedded default with LoRA (--lora-rank 8 --lora-merge-sync), two steps through the controller: the actor's
ranks train adapters only and every push sends merged weights to the engine (docs/lora.md)."""

import math

import pytest
import ray

from conftest import run_steps

from relax.config import parse_config
from relax.config.support import require_supported
from relax.models.embedded import build_embedded_assets

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')


def _trainable(worker) -> tuple[int, int, int]:
    def count(self):
        from relax.backends.megatron.lora import is_adapter_param

        params = list(self.trainer.gpt_model.parameters())
        optimized = sum(p.numel() for g in self.trainer.optimizer.param_groups for p in g["params"])
        return (sum(p.numel() for p in params if p.requires_grad),
                sum(p.numel() for p in params if is_adapter_param(p)), optimized)

    return ray.get(worker.__ray_call__.remote(count))


def test_embedded_default_trains_lora_adapters(tmp_path):
    config = parse_config(["--output-dir", str(tmp_path / "out"), "--num-rollout", "2", "--lora-rank", "8",
                           "--lora-merge-sync"])
    require_supported(config)
    assert config.meta.get("embedded_default")
    # what relax-train does first on the embedded default (relax.core.run)
    build_embedded_assets(config.hf_checkpoint, config.prompt_data, seed=config.seed % 1000)
    seen = {}

    def after_start(controller):
        seen["counts"] = _trainable(controller.workers[0])

    records = run_steps(config, after_start)
    trainable, adapters, optimized = seen["counts"]
    assert trainable == adapters == optimized > 0
    assert len(records) == 2
    for record in records:
        assert math.isfinite(record["train/loss"]) and math.isfinite(record["train/grad_norm"]), record
