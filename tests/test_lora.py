"""LoRA on the Megatron trainer, one rank (relax/backends/megatron/lora.py): the adapters start as the base exactly,
only they train (the base bit for bit unchanged, the optimizer holds only them), the push exports merged weights
that transformers and the embedded engine serve with the trainer's log-probs, and an adapter-only checkpoint
resumes exactly. TP 2 against TP 1: tests/test_lora_parallel.py; the flags: tests/test_lora_config.py."""

import pytest
import torch

from relax.backends.megatron.lora import LoraSettings, adapter_tensors, is_adapter_param
from relax.backends.megatron.testing import (
    hf_response_logprobs,
    hf_trainer,
    toy_pg_loss,
    toy_samples,
)

pytestmark = pytest.mark.usefixtures("megatron_process")

BASE = dict(lr=1e-2, micro_batch_size=2, seed=5, clip_grad=1.0)
LORA = LoraSettings(rank=4, alpha=8.0, seed=5)
LORA_HEAD = LoraSettings(rank=4, alpha=8.0, seed=5, modules_to_save=("output_layer",))  # the LM head trains too
BOTH = pytest.mark.parametrize("lora", [LORA, LORA_HEAD], ids=["adapters", "adapters+head"])
RANDOM_MODEL = {"seed": 3}  # conftest's model_dir builds this random qwen2 model for the module


@pytest.fixture(scope="module")
def samples():
    return toy_samples(4, seed=2)


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_zero_b_gives_the_base_exactly(model_dir, samples):
    base = hf_trainer(model_dir, **BASE)
    lora = hf_trainer(model_dir, **BASE, lora=LORA)
    assert _same(base.compute_logprobs(samples), lora.compute_logprobs(samples))
    names = [n for n, p in lora.gpt_model.named_parameters() if is_adapter_param(p)]
    # 2 layers x (qkv, proj, fc1, fc2) x (A, B)
    assert len(names) == 16 and all(n.endswith((".lora_A", ".lora_B")) for n in names)
    assert sum(p.numel() for p in lora.gpt_model.parameters() if p.requires_grad) == \
        sum(lora.gpt_model.get_parameter(n).numel() for n in names)


def test_one_step_changes_only_the_adapters(model_dir, samples):
    trainer = hf_trainer(model_dir, **BASE, lora=LORA)
    before = {n: p.detach().clone() for n, p in trainer.gpt_model.named_parameters()}
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    adapters = {id(p) for p in trainer.gpt_model.parameters() if is_adapter_param(p)}
    assert optimized == adapters  # the optimizer (and grad clipping over its params) sees only the adapters
    metrics = trainer.train_step(samples, toy_pg_loss)
    assert metrics["grad_norm"] > 0
    for name, param in trainer.gpt_model.named_parameters():
        if is_adapter_param(param) and name.endswith("lora_B"):
            assert not torch.equal(param, before[name]), name  # B leaves zero at the first step
        elif not is_adapter_param(param):
            assert torch.equal(param, before[name]), name  # the frozen base, bit for bit
    # the merged export is the base plus alpha / r * B @ A, and it moved
    exported = dict(trainer.export_hf_weights())
    base = dict(hf_trainer(model_dir, **BASE).export_hf_weights())
    assert not torch.equal(exported["model.layers.0.self_attn.o_proj.weight"],
                           base["model.layers.0.self_attn.o_proj.weight"])
    assert torch.equal(exported["model.embed_tokens.weight"], base["model.embed_tokens.weight"])


@BOTH
def test_merged_export_gives_the_trainers_logprobs(model_dir, samples, tmp_path, lora):
    """The merged weights (what a push sends; with --lora-modules-to-save the trained head too) in transformers give
    the trainer's log-probs."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    trainer = hf_trainer(model_dir, **BASE, lora=lora)
    for _ in range(2):
        trainer.train_step(samples, toy_pg_loss)
    out = tmp_path / "merged"
    shutil.copytree(model_dir, out)
    save_file({n: t.contiguous() for n, t in trainer.export_hf_weights()}, str(out / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    want = trainer.compute_logprobs(samples)
    got = hf_response_logprobs(hf, samples)
    assert max((a - b).abs().max().item() for a, b in zip(want, got)) < 1e-5


@BOTH
def test_adapter_checkpoint_resumes_exactly(model_dir, samples, tmp_path, lora):
    from relax.backends.megatron.checkpoint import load_state_file
    from relax.formats.checkpoint_layout import rank_file

    straight = hf_trainer(model_dir, **BASE, lora=lora)
    want = [straight.train_step(samples, toy_pg_loss) for _ in range(3)]

    first = hf_trainer(model_dir, **BASE, lora=lora)
    got = [first.train_step(samples, toy_pg_loss)]
    path = first.save_checkpoint(tmp_path / "ckpt")
    saved = load_state_file(path / rank_file(0))["model"]
    kept = {f"{module}.weight" for module in lora.modules_to_save}
    assert kept <= set(saved)  # the adapters only, and the modules trained in full
    assert saved and all(k in kept or k.endswith((".lora_A", ".lora_B")) for k in saved)
    del first
    resumed = hf_trainer(model_dir, **BASE, lora=lora)  # the base from the HF folder, as a run's start does
    assert resumed.load_checkpoint(path) == 1
    got += [resumed.train_step(samples, toy_pg_loss) for _ in range(2)]
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(adapter_tensors(resumed.gpt_model).values(),
                                                  adapter_tensors(straight.gpt_model).values()))
    for module in lora.modules_to_save:
        assert torch.equal(getattr(resumed.gpt_model, module).weight, getattr(straight.gpt_model, module).weight)


def test_lora_load_starts_from_saved_adapters(model_dir, samples, tmp_path):
    from relax.backends.megatron.lora import load_adapters

    trained = hf_trainer(model_dir, **BASE, lora=LORA)
    trained.train_step(samples, toy_pg_loss)
    trained.save_checkpoint(tmp_path / "ckpt")
    fresh = hf_trainer(model_dir, **BASE, lora=LORA)
    load_adapters(fresh, str(tmp_path / "ckpt"))
    assert _same(fresh.compute_logprobs(samples), trained.compute_logprobs(samples))
    other = hf_trainer(model_dir, **BASE, lora=LoraSettings(rank=2, alpha=8.0, seed=5))
    with pytest.raises(ValueError, match="--lora-load"):
        load_adapters(other, str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="neither a PEFT adapter"):
        load_adapters(fresh, str(model_dir))


def test_gaussian_init_and_attention_only_targets(model_dir, samples):
    lora = LoraSettings(rank=2, alpha=2.0, init="gaussian", targets=("linear_qkv", "linear_proj"), seed=5)
    trainer = hf_trainer(model_dir, **BASE, lora=lora)
    names = [n for n, p in trainer.gpt_model.named_parameters() if is_adapter_param(p)]
    assert names and all("self_attention" in n for n in names)
    a = trainer.gpt_model.get_parameter(names[0])
    assert 0.2 < a.std().item() < 1.0  # N(0, 1/r^2) with r = 2
    trainer.train_step(samples, toy_pg_loss)
