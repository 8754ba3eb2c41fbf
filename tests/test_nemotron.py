"""Nemotron (HF NemotronForCausalLM) built by Megatron: the squared-ReLU non-gated MLP, the zero-centred LayerNorms
(layernorm1p, with biases) and RoPE on the halves of the first half of each head compute HF's function, the HF <->
Megatron weights round-trip exactly, the embedded engine serves the exported weights, and tensor parallelism (with
and without sequence parallelism) changes nothing."""

import pytest
import torch
from family_checks import check_engine_serves_pushed_weights

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
def nemotron(tmp_path_factory):
    """A tiny random Nemotron (every tensor random, norms and biases included) and its HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = build_random_tiny_model(tmp_path_factory.mktemp("nemotron") / "nemotron", "nemotron", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, ModelArch.from_hf_config(AutoConfig.from_pretrained(path)), hf


def _logits(arch, path, **overrides):
    model = build_gpt_model(arch, to_transformer_config(arch, **overrides)).eval()
    load_hf_weights(model, arch, load_hf_checkpoint_dir(path))
    ids = torch.randint(0, arch.hf_vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model, ids, model(ids, torch.arange(19).unsqueeze(0).expand(2, -1), None)


def test_logits_match_hf_and_export_roundtrips(nemotron):
    ensure_single_process()
    path, arch, hf = nemotron
    assert type(hf).__name__ == "NemotronForCausalLM"
    assert (arch.hf_family, arch.rotary_percent, arch.rotary_interleaved, arch.add_qkv_bias) == ("nemotron", 0.5,
                                                                                                 False, False)
    assert (arch.normalization, arch.swiglu, arch.squared_relu, arch.layernorm_zero_centered_gamma) == (
        "LayerNorm", False, True, True)
    model, ids, ours = _logits(arch, path)
    with torch.no_grad():
        ref = hf(ids).logits
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-5
    names = {n for n, _ in model.named_parameters()}
    assert {"decoder.layers.1.input_layernorm.bias", "decoder.final_layernorm.bias"} <= names
    assert model.decoder.layers[0].mlp.linear_fc1.weight.shape == (arch.ffn_hidden_size, arch.hidden_size)  # no gate

    state = load_hf_checkpoint_dir(path)
    exported = dict(export_hf_weights(model, arch))
    assert set(exported) == set(state.keys())
    assert {"model.layers.0.mlp.up_proj.weight", "model.layers.0.post_attention_layernorm.bias",
            "model.norm.bias"} <= set(exported)
    for name, tensor in exported.items():
        assert torch.equal(tensor, state[name]), name
    # the engines' model takes the exported tensors as they are
    hf_again = type(hf)(hf.config).eval()
    hf_again.load_state_dict(exported, strict=True)
    with torch.no_grad():
        assert torch.equal(hf_again(ids).logits, ref)


def test_each_nemotron_feature_changes_the_logits(nemotron):
    # the match above is no accident of tiny shapes: interleaved RoPE, RoPE on the whole head, plain ReLU or the
    # norms' scale applied without the + 1 each compute another function
    ensure_single_process()
    path, arch, hf = nemotron
    _, ids, ours = _logits(arch, path)
    _, _, interleaved = _logits(arch, path, rotary_interleaved=True)
    assert (interleaved - ours).abs().max().item() > 1e-3
    _, _, relu = _logits(arch, path, activation_func=torch.nn.functional.relu)
    assert (relu - ours).abs().max().item() > 1e-3
    norm = _logits(arch, path)[0].decoder.final_layernorm
    x = torch.randn(3, arch.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # HF's NemotronLayerNorm1P: layer_norm(x, weight + 1, bias, eps)
        expected = torch.nn.functional.layer_norm(x, (arch.hidden_size,), norm.weight + 1, norm.bias, arch.norm_epsilon)
        torch.testing.assert_close(norm(x), expected, rtol=0, atol=0)
        plain = torch.nn.functional.layer_norm(x, (arch.hidden_size,), norm.weight, norm.bias, arch.norm_epsilon)
        assert (plain - expected).abs().max().item() > 1e-1
    whole = ModelArch.from_hf_config({**hf.config.to_dict(), "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}})
    assert whole.rotary_percent == 1.0
    _, _, rotated = _logits(whole, path)
    assert (rotated - ours).abs().max().item() > 1e-3


def test_the_embedded_engine_serves_the_exported_weights(nemotron):
    # a weight push: Megatron's Nemotron after an update (here: noise), exported, copied into the engine's HF model
    ensure_single_process()
    path, arch, hf = nemotron
    model, _, _ = _logits(arch, path)
    check_engine_serves_pushed_weights(model, arch, path, hf, "NemotronForCausalLM")


def _tp_worker(rank, world, path, samples):
    out = {}
    for name, sp in (("tp", False), ("sp", True)):
        trainer = hf_trainer(path, lr=1e-3, micro_batch_size=2, seed=11, tp=2, sequence_parallel=sp)
        post = [p for n, p in trainer.gpt_model.named_parameters() if "layernorm" in n]
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


def test_tensor_and_sequence_parallel_give_hf_logprobs_and_weights(nemotron):
    path, arch, hf = nemotron
    samples = toy_samples(4, seed=5, vocab=arch.hf_vocab_size)
    ranks = run_ranks(_tp_worker, 2, str(path), samples, timeout=300)
    expected = hf_response_logprobs(hf, samples)
    state = load_hf_checkpoint_dir(path)
    for rank in ranks:
        for name in ("tp", "sp"):
            got = rank[name]
            for a, b in zip(got["logprobs"], expected):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            assert set(got["weights"]) == set(state.keys())
            assert all(torch.equal(t, state[k]) for k, t in got["weights"].items())
            # each layer's two LayerNorms (weight and bias) and the final one
            assert len(got["marked"]) == 4 * arch.num_layers + 2 and all(got["marked"]) == (name == "sp")
            assert not any(got["marked"]) or name == "sp"
        assert rank["sp"]["loss"] == pytest.approx(rank["tp"]["loss"], rel=1e-6)
    # under sequence parallelism each rank's norms see half the sequence: their gradients are summed, so the
    # replicas stay equal (and equal to those of tensor parallelism alone)
    for a, b, c in zip(ranks[0]["sp"]["post_after"], ranks[1]["sp"]["post_after"], ranks[0]["tp"]["post_after"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
