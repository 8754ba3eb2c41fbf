"""The PEFT export of LoRA adapters (--save-hf with --lora-rank; relax/backends/megatron/lora_peft.py): the folder
holds adapter_config.json + adapter_model.safetensors, `peft` loads it onto the HF base and gives the trainer's
log-probs, and --lora-load reads it back into the trainer exactly. Under TP 2: tests/test_lora_parallel.py."""

import json

import pytest
import torch

from relax.backends.megatron.lora import LoraSettings, load_adapters
from relax.backends.megatron.testing import build_random_tiny_model, hf_response_logprobs, hf_trainer, toy_pg_loss, toy_samples

pytestmark = pytest.mark.usefixtures("megatron_process")
peft = pytest.importorskip("peft")  # setup.py's test extras

BASE = dict(lr=2e-2, micro_batch_size=2, seed=4)


def _save_hf(trainer, tmp_path, source):
    from relax.backends.megatron.checkpoint import finish_hf_folder, snapshot_rank, write_rank

    hf_dir = tmp_path / "hf"
    snap = snapshot_rank(trainer, save_optim=False, hf=True)
    write_rank(snap, tmp_path / "ckpt", hf_dir)
    finish_hf_folder(hf_dir, [snap.hf_part()], str(source))
    return hf_dir


@pytest.mark.parametrize("family, targets", [("qwen2", ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")),
                                             ("llama", ("linear_qkv", "linear_fc2"))])
def test_peft_export_loads_in_peft_with_the_trainers_logprobs(tmp_path, family, targets):
    from transformers import AutoModelForCausalLM

    model_dir = build_random_tiny_model(tmp_path / family, family, seed=6)
    samples = toy_samples(4, seed=8)
    lora = LoraSettings(rank=4, alpha=12.0, targets=targets, seed=4)
    trainer = hf_trainer(model_dir, **BASE, lora=lora)
    for _ in range(2):
        trainer.train_step(samples, toy_pg_loss)
    hf_dir = _save_hf(trainer, tmp_path, model_dir)
    assert sorted(p.name for p in hf_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((hf_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 12.0, str(model_dir))

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, str(hf_dir)).eval()
    want = trainer.compute_logprobs(samples)
    got = hf_response_logprobs(model, samples)
    assert max((a - b).abs().max().item() for a, b in zip(want, got)) < 1e-5
    plain = hf_response_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), samples)
    assert max((a - b).abs().max().item() for a, b in zip(want, plain)) > 1e-3  # the adapters changed something

    fresh = hf_trainer(model_dir, **BASE, lora=lora)  # --lora-load of the PEFT folder: the trained adapters exactly
    load_adapters(fresh, str(hf_dir))
    assert all(torch.equal(a, b) for a, b in zip(fresh.compute_logprobs(samples), want))


def test_peft_adapters_not_sharing_a_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = build_random_tiny_model(tmp_path / "m", "qwen2", seed=6)
    lora = LoraSettings(rank=2, alpha=2.0, targets=("linear_qkv",), seed=4)
    trainer = hf_trainer(model_dir, **BASE, lora=lora)
    trainer.train_step(toy_samples(4, seed=8), toy_pg_loss)
    hf_dir = _save_hf(trainer, tmp_path, model_dir)
    state = load_file(str(hf_dir / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    state[key] = state[key] + 1.0
    save_file(state, str(hf_dir / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="do not share A"):
        load_adapters(hf_trainer(model_dir, **BASE, lora=lora), str(hf_dir))
    with pytest.raises(KeyError, match="target_modules"):
        load_adapters(hf_trainer(model_dir, **BASE, lora=LoraSettings(rank=2, alpha=2.0, seed=4)), str(hf_dir))
