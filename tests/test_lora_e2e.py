"""The embedded default with LoRA, through the controller (docs/lora.md): merged-weight sync (--lora-merge-sync),
adapter-only sync, adapter-only sync in fully-async mode, and merged sync with the LM head trained beside the
adapters (--lora-modules-to-save)."""

import math
from pathlib import Path

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


TEMPERATURE = 1.0
PROMPTS = [[3, 9, 17, 25, 33, 41], [5, 6, 7, 8]]


def no_correction(pg_loss, train_logprobs, rollout_logprobs, mask):
    """--custom-tis-function-path that changes nothing (--get-mismatch-metrics asks for one)."""
    return pg_loss, mask, {}


def _engine_and_trainer_logprobs(controller):
    """The first engine's log-probs of a fixed batch (requests naming the trainer's adapter, SGLang's lora_path) and
    the trainer's of the same tokens, plus the engine's weight version."""
    from relax.backends.embedded.testing import response_logprobs
    from relax.config.rules_lora import ADAPTER_NAME
    from relax.wire.engine_client import EngineClient

    url = ray.get(controller.ctx.rollout.get_engine_urls.remote())[0]
    client = EngineClient(url, timeout_s=60)
    try:
        out = client.generate(PROMPTS, {"temperature": TEMPERATURE, "max_new_tokens": 6, "ignore_eos": True},
                              return_logprob=True, lora_path=ADAPTER_NAME)
        base = client.generate(PROMPTS, {"temperature": TEMPERATURE, "max_new_tokens": 6, "ignore_eos": True},
                               return_logprob=True)
        version = client.get_weight_version()
    finally:
        client.close()
    tokens = [p + r["output_ids"] for p, r in zip(PROMPTS, out)]
    lengths = [len(r["output_ids"]) for r in out]
    trainer = ray.get([w.compute_logprobs.remote(tokens, lengths, TEMPERATURE) for w in controller.workers])[0]
    return [response_logprobs(r) for r in out], trainer, version, [response_logprobs(r) for r in base]


def test_adapter_only_sync_serves_the_trainers_policy(tmp_path):
    """--lora-rank without --lora-merge-sync: each push moves the adapter alone (relax.backends.megatron.lora_sync),
    the rollout's requests name it, and after the last push the engine's log-probs equal the trainer's."""
    from safetensors import safe_open

    config = parse_config(["--output-dir", str(tmp_path / "out"), "--num-rollout", "2", "--lora-rank", "8",
                           "--get-mismatch-metrics", "--custom-tis-function-path", "test_lora_e2e.no_correction",
                           "--check-weight-update-equal"])
    require_supported(config)
    build_embedded_assets(config.hf_checkpoint, config.prompt_data, seed=config.seed % 1000)
    seen = {}

    def after_start(controller):
        run = controller.run

        def run_then_compare():  # before the controller shuts the engines down
            run()
            seen["logprobs"] = _engine_and_trainer_logprobs(controller)

        controller.run = run_then_compare

    records = run_steps(config, after_start)
    assert len(records) == 2
    engine, trainer, version, base = seen["logprobs"]
    assert version == "2"  # the second push's
    assert max(abs(a - b) for got, want in zip(engine, trainer) for a, b in zip(got, want)) <= 1e-5
    # the adapter's change reached the engine: the same engine's base differs from the trained policy
    assert max(abs(a - b) for got, want in zip(engine, base) for a, b in zip(got, want)) > 1e-4
    # step 1 was generated after the first push: the rollout's requests named the adapter, so the engine's
    # log-probs are the trainer's (step 0's were the base's, which is the adapter at B = 0)
    for record in records:
        assert record["train/mismatch_logprob_abs_diff_mean"] <= 1e-5, record
        assert abs(record["train/mismatch_ratio_max"] - 1) <= 1e-4 >= abs(record["train/mismatch_ratio_min"] - 1)
    # each push moved the adapter only: the PEFT file's bytes, every tensor rank 8 on one side
    pushed = Path(config.output_dir) / "lora_push" / "v2" / "adapter_model.safetensors"
    with safe_open(str(pushed), "pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys()]
    assert shapes and all(s[0] == 8 or s[1] == 8 for s in shapes)
    assert all(r["perf/weight_sync_bytes"] == pushed.stat().st_size for r in records)
    model_bytes = sum(p.stat().st_size for p in Path(config.hf_checkpoint).glob("*.safetensors"))
    assert pushed.stat().st_size < 0.2 * model_bytes


def test_fully_async_with_adapter_only_sync(tmp_path):
    """--fully-async with LoRA adapter-only sync: the rollout of a step runs beside the training of the one before,
    each push (generation paused in place) moves the adapter alone, and at the end the engine serves the trainer's
    policy."""
    config = parse_config(["--output-dir", str(tmp_path / "out"), "--num-rollout", "3", "--lora-rank", "8",
                           "--fully-async", "--max-staleness", "1", "--check-weight-update-equal"])
    require_supported(config)
    build_embedded_assets(config.hf_checkpoint, config.prompt_data, seed=config.seed % 1000)
    seen = {}

    def after_start(controller):
        run = controller.run

        def run_then_compare():
            run()
            seen["logprobs"] = _engine_and_trainer_logprobs(controller)

        controller.run = run_then_compare

    records = run_steps(config, after_start)
    assert len(records) == 3
    pushed = Path(config.output_dir) / "lora_push" / "v3" / "adapter_model.safetensors"
    for record in records:
        assert math.isfinite(record["train/loss"]) and record["async/staleness_max"] <= 1, record
        assert record["perf/weight_sync_bytes"] == pushed.stat().st_size, record
    engine, trainer, version, base = seen["logprobs"]
    assert version == "3"
    assert max(abs(a - b) for got, want in zip(engine, trainer) for a, b in zip(got, want)) <= 1e-5
    assert max(abs(a - b) for got, want in zip(engine, base) for a, b in zip(got, want)) > 1e-4


def test_merged_sync_with_the_trained_head(tmp_path):
    """--lora-modules-to-save output_layer (what the embedded default needs to learn with LoRA, docs/lora.md): the
    trainer trains and optimizes the adapters and the LM head only, and each merged push carries the trained head:
    step 1, generated after the first push, has the trainer's log-probs on the engine. (With the head left out of
    the export the engine's log-probs differ by ~4.6 and this fails.)"""
    config = parse_config(["--output-dir", str(tmp_path / "out"), "--num-rollout", "2", "--lora-rank", "8",
                           "--lora-merge-sync", "--lora-modules-to-save", "output_layer", "--get-mismatch-metrics",
                           "--custom-tis-function-path", "test_lora_e2e.no_correction", "--check-weight-update-equal"])
    require_supported(config)
    build_embedded_assets(config.hf_checkpoint, config.prompt_data, seed=config.seed % 1000)
    seen = {}

    def count(self):
        from relax.backends.megatron.lora import is_adapter_param, is_saved_module_param

        params = list(self.trainer.gpt_model.parameters())
        optimized = sum(p.numel() for g in self.trainer.optimizer.param_groups for p in g["params"])
        return (sum(p.numel() for p in params if p.requires_grad), optimized,
                sum(p.numel() for p in params if is_adapter_param(p)),
                sum(p.numel() for p in params if is_saved_module_param(p)),
                self.trainer.gpt_model.output_layer.weight.numel())

    def after_start(controller):
        seen["counts"] = ray.get(controller.workers[0].__ray_call__.remote(count))

    records = run_steps(config, after_start)
    trainable, optimized, adapters, saved, head = seen["counts"]
    assert trainable == optimized == adapters + saved and saved == head > 0
    assert len(records) == 2
    for record in records:  # step 0: the base on both sides; step 1: after a push of moved adapters and head
        assert record["train/mismatch_logprob_abs_diff_mean"] <= 1e-5, record
