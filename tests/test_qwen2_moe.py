"""Qwen2-MoE (HF Qwen2MoeForCausalLM) built by Megatron: routed experts plus megatron-core's SharedExpertMLP with its
sigmoid gate compute HF's function, the HF <-> Megatron weights round-trip exactly, the embedded engine serves the
exported weights, and tensor (with sequence) and expert parallelism change nothing."""

import dataclasses

import pytest
import torch
from family_checks import check_engine_serves_pushed_weights
from safetensors.torch import save_file

from relax.backends.megatron.arch import ModelArch, to_transformer_config
from relax.backends.megatron.hf_weights import export_hf_weights, load_hf_checkpoint_dir, load_hf_weights
from relax.backends.megatron.model import build_gpt_model
from relax.backends.megatron.testing import (
    build_random_tiny_model,
    ensure_single_process,
    hf_response_logprobs,
    hf_trainer,
    run_ranks,
    toy_pg_loss,
    toy_samples,
)

torch.set_num_threads(1)

@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """A tiny random Qwen2-MoE (every tensor random: router, experts, shared expert and its gate, norms, biases)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = build_random_tiny_model(tmp_path_factory.mktemp("qwen2moe") / "qwen2moe", "qwen2_moe", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, ModelArch.from_hf_config(AutoConfig.from_pretrained(path)), hf


def _model(arch, path, strict=True, **overrides):
    model = build_gpt_model(arch, to_transformer_config(arch, **overrides)).eval()
    load_hf_weights(model, arch, load_hf_checkpoint_dir(path), strict=strict)
    return model


def _logits(model, arch):
    ids = torch.randint(0, arch.hf_vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return ids, model(ids, torch.arange(19).unsqueeze(0).expand(2, -1), None)


def test_logits_match_hf_and_export_roundtrips(qwen2_moe, tmp_path):
    ensure_single_process()
    path, arch, hf = qwen2_moe
    assert type(hf).__name__ == "Qwen2MoeForCausalLM"
    assert (arch.hf_family, arch.num_experts, arch.moe_router_topk, arch.moe_norm_topk_prob, arch.add_qkv_bias,
            arch.qk_layernorm) == ("qwen2_moe", 4, 2, False, True, False)
    assert (arch.moe_shared_expert_intermediate_size, arch.moe_shared_expert_gate) == (48, True)
    model = _model(arch, path)
    shared = dict(model.decoder.layers[0].mlp.shared_experts.named_parameters())
    assert shared["gate_weight"].shape == (1, arch.hidden_size)
    assert shared["linear_fc1.weight"].shape == (2 * 48, arch.hidden_size)
    ids, ours = _logits(model, arch)
    with torch.no_grad():
        ref = hf(ids).logits
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-5

    state = load_hf_checkpoint_dir(path)
    exported = dict(export_hf_weights(model, arch))
    assert set(exported) == set(state.keys())
    assert {"model.layers.1.mlp.shared_expert.up_proj.weight", "model.layers.1.mlp.shared_expert_gate.weight",
            "model.layers.1.self_attn.q_proj.bias"} <= set(exported)
    for name, tensor in exported.items():
        assert torch.equal(tensor, state[name]), name
    # an HF folder of the exported tensors (per-expert names, as checkpoints hold them) loads as the same model
    folder = tmp_path / "exported"
    hf.config.save_pretrained(folder)
    save_file({k: t.contiguous() for k, t in exported.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    hf_again = type(hf).from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(hf_again(ids).logits, ref)


def test_each_qwen2_moe_feature_changes_the_logits(qwen2_moe):
    # the match above is no accident of tiny shapes: without the gate, with renormalised top-k weights or with the
    # gate's sigmoid replaced by its logit, Megatron computes another function
    from megatron.core.transformer.mlp import MLP

    ensure_single_process()
    path, arch, _ = qwen2_moe
    _, ours = _logits(_model(arch, path), arch)
    ungated = _model(arch, path, strict=False, moe_shared_expert_gate=False)  # HF's gate tensors unused
    _, no_gate = _logits(ungated, arch)
    assert (no_gate - ours).abs().max().item() > 1e-3
    renormed = dataclasses.replace(arch, moe_norm_topk_prob=True)
    _, topk = _logits(_model(renormed, path), arch)
    assert (topk - ours).abs().max().item() > 1e-3
    # the gate is sigmoid(x @ gate^T) per token, multiplied into the shared expert's output: HF's shared_expert_gate
    mlp = _model(arch, path).decoder.layers[0].mlp.shared_experts
    x = torch.randn(5, 1, arch.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain, _ = MLP.forward(mlp, x)  # megatron-core's MLP without the gate
        torch.testing.assert_close(mlp(x), plain * torch.sigmoid(x @ mlp.gate_weight.T), rtol=0, atol=1e-6)


def test_the_embedded_engine_serves_the_exported_weights(qwen2_moe):
    # a weight push: Megatron's Qwen2-MoE after an update (here: noise), exported, copied into the engine's HF model
    ensure_single_process()
    path, arch, hf = qwen2_moe
    model = _model(arch, path)
    check_engine_serves_pushed_weights(model, arch, path, hf, "Qwen2MoeForCausalLM")


def _parallel_worker(rank, world, path, samples):
    from megatron.core import parallel_state as ps

    out = {}
    for name, layout in (("tp", dict(tp=2)), ("sp", dict(tp=2, sequence_parallel=True)), ("ep", dict(ep=2))):
        trainer = hf_trainer(path, lr=1e-3, micro_batch_size=2, seed=11, **layout)
        per = len(samples) // trainer.layout.dp
        mine = samples[trainer.layout.dp_rank * per:(trainer.layout.dp_rank + 1) * per]
        shared = [p for n, p in trainer.gpt_model.named_parameters() if ".shared_experts." in n]
        out[name] = {
            "logprobs": trainer.compute_logprobs(mine),
            "dp_rank": trainer.layout.dp_rank, "per": per,
            "weights": dict(trainer.export_hf_weights()),
            "shared_shapes": [tuple(p.shape) for p in shared],
        }
        if name != "tp":  # megatron-core trains MoE layers under tensor parallelism only with sequence parallelism
            out[name]["loss"] = trainer.train_step(mine, toy_pg_loss)["loss"]
        ps.destroy_model_parallel()
    return out


def test_tensor_sequence_and_expert_parallel_give_hf_logprobs_and_weights(qwen2_moe):
    path, arch, hf = qwen2_moe
    samples = toy_samples(4, seed=5, vocab=arch.hf_vocab_size)
    ranks = run_ranks(_parallel_worker, 2, str(path), samples, timeout=300)
    expected = hf_response_logprobs(hf, samples)
    state = load_hf_checkpoint_dir(path)
    ensure_single_process()
    ref_loss = hf_trainer(path, lr=1e-3, micro_batch_size=2, seed=11).train_step(samples, toy_pg_loss)["loss"]
    hidden, shared = arch.hidden_size, arch.moe_shared_expert_intermediate_size
    for rank in ranks:
        for name in ("tp", "sp", "ep"):
            got = rank[name]
            first = got["dp_rank"] * got["per"]
            for a, b in zip(got["logprobs"], expected[first:first + got["per"]], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            assert set(got["weights"]) == set(state.keys())
            assert all(torch.equal(t, state[k]) for k, t in got["weights"].items())
        # TP splits the shared expert's MLP (gate/up rows, down columns) and keeps its gate whole
        assert sorted(rank["tp"]["shared_shapes"][:3]) == sorted([(1, hidden), (shared, hidden), (hidden, shared // 2)])
        for name in ("sp", "ep"):  # the step's loss over all samples, as one process computes it
            assert rank[name]["loss"] == pytest.approx(ref_loss, rel=1e-5), name
