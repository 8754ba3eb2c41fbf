"""--lora-modules-to-save output_layer (PEFT's modules_to_save): the LM head trains in full beside the adapters.

Why (docs/lora.md, "Learning on the embedded default"): with the head and the final norm frozen, no change of the
transformer body can raise the embedded default's answer probability above ~0.3, so LoRA alone plateaus there.
These tests: the head is in the optimizer and moves, the rest of the base stays bit for bit; the flag and its
refusals before Ray. The merged push and the adapter checkpoint with the head: tests/test_lora.py (parametrized
over adapters alone and adapters + head). relax/backends/megatron/lora.py, relax/config/rules_lora.py."""

import pytest
import torch

from relax.backends.megatron.lora import LoraSettings, is_adapter_param, is_saved_module_param
from relax.backends.megatron.testing import hf_trainer, toy_pg_loss, toy_samples
from relax.config import parse_config
from relax.config.errors import ConfigError

pytestmark = pytest.mark.usefixtures("megatron_process")

BASE = dict(lr=1e-2, micro_batch_size=2, seed=5, clip_grad=1.0)
LORA_HEAD = LoraSettings(rank=4, alpha=8.0, seed=5, modules_to_save=("output_layer",))
RANDOM_MODEL = {"seed": 3}  # conftest's model_dir: a random untied qwen2 model for the module


@pytest.fixture(scope="module")
def samples():
    return toy_samples(4, seed=2)


def test_head_trains_beside_the_adapters_and_the_rest_stays(model_dir, samples):
    trainer = hf_trainer(model_dir, **BASE, lora=LORA_HEAD)
    gpt = trainer.gpt_model
    before = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    head = [n for n, p in gpt.named_parameters() if is_saved_module_param(p)]
    assert head == ["output_layer.weight"]
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in gpt.parameters() if is_adapter_param(p) or is_saved_module_param(p)}
    trainer.train_step(samples, toy_pg_loss)
    for name, param in gpt.named_parameters():
        moved = not torch.equal(param, before[name])
        if name == "output_layer.weight" or name.endswith("lora_B"):
            assert moved, name
        elif not is_adapter_param(param):
            assert not moved, name  # the frozen base, bit for bit
    exported = dict(trainer.export_hf_weights())
    base = dict(hf_trainer(model_dir, **BASE).export_hf_weights())
    assert not torch.equal(exported["lm_head.weight"], base["lm_head.weight"])
    assert torch.equal(exported["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert torch.equal(exported["model.norm.weight"], base["model.norm.weight"])


CONFIG = ["--hf-checkpoint", "unused-model-dir", "--rollout-batch-size", "2", "--n-samples-per-prompt", "3",
          "--global-batch-size", "6"]


def test_flag_reaches_the_settings():
    from relax.backends.megatron.lora import lora_settings
    from relax.config.support import require_supported

    config = parse_config([*CONFIG, "--lora-rank", "8", "--lora-merge-sync", "--lora-modules-to-save", "output_layer"])
    require_supported(config)
    assert lora_settings(config).modules_to_save == ("output_layer",)
    assert lora_settings(parse_config([*CONFIG, "--lora-rank", "8", "--lora-merge-sync"])).modules_to_save == ()


@pytest.mark.parametrize("args, message", [
    (["--lora-rank", "8", "--lora-modules-to-save", "output_layer"],
     "adapter-only sync (--lora-rank without --lora-merge-sync) with --lora-modules-to-save"),
    (["--lora-rank", "8", "--lora-merge-sync", "--lora-modules-to-save", "embedding"],
     "--lora-modules-to-save embedding: unknown"),
    (["--lora-rank", "8", "--lora-merge-sync", "--lora-modules-to-save", "output_layer", "--save-hf", "/tmp/hf"],
     "not supported yet: --save-hf with --lora-modules-to-save"),
    (["--lora-modules-to-save", "output_layer"], "--lora-modules-to-save set without --lora-rank"),
])
def test_refusals(args, message):
    with pytest.raises(ConfigError) as err:
        parse_config([*CONFIG, *args])
    assert message in str(err.value)
