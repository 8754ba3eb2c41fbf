"""The model families Megatron builds beside qwen2, each a tiny random model (every tensor random: norms, biases,
router, experts, shared expert and its gate) against its HF model, parametrized over the families:

- GLM4 (HF Glm4ForCausalLM): partial interleaved RoPE and the post-sublayer norms;
- Nemotron (HF NemotronForCausalLM): the squared-ReLU non-gated MLP, the zero-centred LayerNorms (layernorm1p, with
  biases) and RoPE on the halves of the first half of each head;
- Qwen2-MoE (HF Qwen2MoeForCausalLM): routed experts plus megatron-core's SharedExpertMLP with its sigmoid gate.

Each computes HF's function, the HF <-> Megatron weights round-trip exactly, the embedded engine serves the
exported weights, and tensor parallelism (with and without sequence parallelism; for Qwen2-MoE expert parallelism
too) changes nothing."""

import dataclasses

import pytest
import torch
from family_checks import check_engine_serves_pushed_weights
from safetensors.torch import save_file

from relax.backends.megatron.transformer_config import to_transformer_config
from relax.formats.model_arch import ModelArch
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

HF_CLASS = {"glm4": "Glm4ForCausalLM", "nemotron": "NemotronForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


@pytest.fixture(scope="module", params=list(HF_CLASS))
def family(request, tmp_path_factory):
    """(family, path, arch, hf): a tiny random model of the family (seed 3), its ModelArch and its HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    name = request.param
    path = build_random_tiny_model(tmp_path_factory.mktemp(name) / name, name, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return name, path, ModelArch.from_hf_config(AutoConfig.from_pretrained(path)), hf


def one_family(name):
    """The test runs for this family only (its features are its own)."""
    return pytest.mark.parametrize("family", [name], indirect=True)


def _model(arch, path, strict=True, **overrides):
    model = build_gpt_model(arch, to_transformer_config(arch, **overrides)).eval()
    load_hf_weights(model, arch, load_hf_checkpoint_dir(path), strict=strict)
    return model


def _logits(model, arch):
    ids = torch.randint(0, arch.hf_vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return ids, model(ids, torch.arange(19).unsqueeze(0).expand(2, -1), None)


# ------------------------------------------------------------------------------------- each family's features
def _glm4_arch(arch, model):
    assert (arch.hf_family, arch.rotary_percent, arch.rotary_interleaved, arch.add_qkv_bias) == ("glm4", 0.5, True,
                                                                                                 True)
    assert arch.post_self_attn_layernorm and arch.post_mlp_layernorm
    names = {n for n, _ in model.named_parameters()}
    assert {"decoder.layers.1.post_self_attn_layernorm.weight", "decoder.layers.1.post_mlp_layernorm.weight"} <= names


def _nemotron_arch(arch, model):
    assert (arch.hf_family, arch.rotary_percent, arch.rotary_interleaved, arch.add_qkv_bias) == ("nemotron", 0.5,
                                                                                                 False, False)
    assert (arch.normalization, arch.swiglu, arch.squared_relu, arch.layernorm_zero_centered_gamma) == (
        "LayerNorm", False, True, True)
    names = {n for n, _ in model.named_parameters()}
    assert {"decoder.layers.1.input_layernorm.bias", "decoder.final_layernorm.bias"} <= names
    assert model.decoder.layers[0].mlp.linear_fc1.weight.shape == (arch.ffn_hidden_size, arch.hidden_size)  # no gate


def _qwen2_moe_arch(arch, model):
    assert (arch.hf_family, arch.num_experts, arch.moe_router_topk, arch.moe_norm_topk_prob, arch.add_qkv_bias,
            arch.qk_layernorm) == ("qwen2_moe", 4, 2, False, True, False)
    assert (arch.moe_shared_expert_intermediate_size, arch.moe_shared_expert_gate) == (48, True)
    shared = dict(model.decoder.layers[0].mlp.shared_experts.named_parameters())
    assert shared["gate_weight"].shape == (1, arch.hidden_size)
    assert shared["linear_fc1.weight"].shape == (2 * 48, arch.hidden_size)


CHECK_ARCH = {"glm4": _glm4_arch, "nemotron": _nemotron_arch, "qwen2_moe": _qwen2_moe_arch}
# HF names the export must give (the gated MLP's fused gate_up, Nemotron's norm biases, the shared expert and its gate)
EXPORTED = {
    "glm4": {"model.layers.0.mlp.gate_up_proj.weight"},
    "nemotron": {"model.layers.0.mlp.up_proj.weight", "model.layers.0.post_attention_layernorm.bias",
                 "model.norm.bias"},
    "qwen2_moe": {"model.layers.1.mlp.shared_expert.up_proj.weight", "model.layers.1.mlp.shared_expert_gate.weight",
                  "model.layers.1.self_attn.q_proj.bias"},
}


def _hf_with(exported, hf, folder, name):
    """An HF model of `hf`'s class holding the exported tensors: the engines' model takes them as they are; a
    Qwen2-MoE folder of them (per-expert names, as checkpoints hold them) loads as the same model."""
    if name != "qwen2_moe":
        hf_again = type(hf)(hf.config).eval()
        hf_again.load_state_dict(exported, strict=True)
        return hf_again
    hf.config.save_pretrained(folder)
    save_file({k: t.contiguous() for k, t in exported.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return type(hf).from_pretrained(folder, dtype=torch.float32).eval()


def test_logits_match_hf_and_export_roundtrips(family, tmp_path):
    ensure_single_process()
    name, path, arch, hf = family
    assert type(hf).__name__ == HF_CLASS[name]
    model = _model(arch, path)
    CHECK_ARCH[name](arch, model)
    ids, ours = _logits(model, arch)
    with torch.no_grad():
        ref = hf(ids).logits
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-5

    state = load_hf_checkpoint_dir(path)
    exported = dict(export_hf_weights(model, arch))
    assert set(exported) == set(state.keys())
    assert EXPORTED[name] <= set(exported)
    for key, tensor in exported.items():
        assert torch.equal(tensor, state[key]), key
    hf_again = _hf_with(exported, hf, tmp_path / "exported", name)
    with torch.no_grad():
        assert torch.equal(hf_again(ids).logits, ref)


def _check_rope_on_the_whole_head_differs(path, hf, ours):
    """The partial RoPE's family with RoPE on the whole head computes other logits than `ours`."""
    whole = ModelArch.from_hf_config({**hf.config.to_dict(), "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}})
    assert whole.rotary_percent == 1.0
    _, rotated = _logits(_model(whole, path), whole)
    assert (rotated - ours).abs().max().item() > 1e-3


@one_family("glm4")
def test_each_glm4_feature_changes_the_logits(family):
    # the match above is no accident of tiny shapes: half-split RoPE, or RoPE on the whole head, computes another
    # function (the post-sublayer norms are random, far from identity, and the weights' names are checked above)
    ensure_single_process()
    _, path, arch, hf = family
    _, ours = _logits(_model(arch, path), arch)
    _, half_split = _logits(_model(arch, path, rotary_interleaved=False), arch)
    assert (half_split - ours).abs().max().item() > 1e-3
    _check_rope_on_the_whole_head_differs(path, hf, ours)


@one_family("nemotron")
def test_each_nemotron_feature_changes_the_logits(family):
    # the match above is no accident of tiny shapes: interleaved RoPE, RoPE on the whole head, plain ReLU or the
    # norms' scale applied without the + 1 each compute another function
    ensure_single_process()
    _, path, arch, hf = family
    _, ours = _logits(_model(arch, path), arch)
    _, interleaved = _logits(_model(arch, path, rotary_interleaved=True), arch)
    assert (interleaved - ours).abs().max().item() > 1e-3
    _, relu = _logits(_model(arch, path, activation_func=torch.nn.functional.relu), arch)
    assert (relu - ours).abs().max().item() > 1e-3
    norm = _model(arch, path).decoder.final_layernorm
    x = torch.randn(3, arch.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # HF's NemotronLayerNorm1P: layer_norm(x, weight + 1, bias, eps)
        expected = torch.nn.functional.layer_norm(x, (arch.hidden_size,), norm.weight + 1, norm.bias, arch.norm_epsilon)
        torch.testing.assert_close(norm(x), expected, rtol=0, atol=0)
        plain = torch.nn.functional.layer_norm(x, (arch.hidden_size,), norm.weight, norm.bias, arch.norm_epsilon)
        assert (plain - expected).abs().max().item() > 1e-1
    _check_rope_on_the_whole_head_differs(path, hf, ours)


@one_family("qwen2_moe")
def test_each_qwen2_moe_feature_changes_the_logits(family):
    # the match above is no accident of tiny shapes: without the gate, with renormalised top-k weights or with the
    # gate's sigmoid replaced by its logit, Megatron computes another function
    from megatron.core.transformer.mlp import MLP

    ensure_single_process()
    _, path, arch, _ = family
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


def test_the_embedded_engine_serves_the_exported_weights(family):
    # a weight push: the family's Megatron model after an update (here: noise), exported, copied into the engine's
    # HF model
    ensure_single_process()
    name, path, arch, hf = family
    check_engine_serves_pushed_weights(_model(arch, path), arch, path, hf, HF_CLASS[name])


# ------------------------------------------------------------------------------------- parallel layouts
# the dense families' norms (GLM4's post-sublayer norms; Nemotron's LayerNorms: each layer's two, weight and
# bias, and the final one) and how many parameters they are
NORMS = {"glm4": (".post_", lambda arch: 2 * arch.num_layers),
         "nemotron": ("layernorm", lambda arch: 4 * arch.num_layers + 2)}


def _tp_worker(rank, world, path, samples, norms):
    out = {}
    for name, sp in (("tp", False), ("sp", True)):
        trainer = hf_trainer(path, lr=1e-3, micro_batch_size=2, seed=11, tp=2, sequence_parallel=sp)
        post = [p for n, p in trainer.gpt_model.named_parameters() if norms in n]
        out[name] = {
            "logprobs": trainer.compute_logprobs(samples),
            "weights": dict(trainer.export_hf_weights()),
            "marked": [bool(getattr(p, "sequence_parallel", False)) for p in post],
            "loss": trainer.train_step(samples, toy_pg_loss)["loss"],
            "post_after": [p.detach().clone() for p in post],
        }
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("family", list(NORMS), indirect=True)
def test_tensor_and_sequence_parallel_give_hf_logprobs_and_weights(family):
    family_name, path, arch, hf = family
    norms, count = NORMS[family_name]
    samples = toy_samples(4, seed=5, vocab=arch.hf_vocab_size)
    ranks = run_ranks(_tp_worker, 2, str(path), samples, norms, timeout=300)
    expected = hf_response_logprobs(hf, samples)
    state = load_hf_checkpoint_dir(path)
    for rank in ranks:
        for name in ("tp", "sp"):
            got = rank[name]
            for a, b in zip(got["logprobs"], expected):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            assert set(got["weights"]) == set(state.keys())
            assert all(torch.equal(t, state[k]) for k, t in got["weights"].items())
            assert len(got["marked"]) == count(arch) and all(got["marked"]) == (name == "sp")
            assert not any(got["marked"]) or name == "sp"
        assert rank["sp"]["loss"] == pytest.approx(rank["tp"]["loss"], rel=1e-6)
    # under sequence parallelism each rank's norms see half the sequence: their gradients are summed, so the
    # replicas stay equal (and equal to those of tensor parallelism alone)
    for a, b, c in zip(ranks[0]["sp"]["post_after"], ranks[1]["sp"]["post_after"], ranks[0]["tp"]["post_after"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


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


@one_family("qwen2_moe")
def test_tensor_sequence_and_expert_parallel_give_hf_logprobs_and_weights(family):
    _, path, arch, hf = family
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
