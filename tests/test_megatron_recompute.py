"""Activation recompute (--recompute-granularity/-method/-num-layers/-modules) through Megatron-core's own
TransformerConfig: refused combinations name the flags before Ray; every accepted setting trains to the same
loss, gradients and weights as no recompute, and really recomputes (layers run again in backward)."""

import pytest
import torch

from relax.backends.megatron.testing import hf_trainer, toy_pg_loss, toy_samples
from relax.config import parse_config
from relax.config.errors import ConfigError
from relax.config.support import unsupported_flags
from relax.roles.megatron_settings import trainer_settings

torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("megatron_process")  # tests/megatron_fixtures.py
RANDOM_MODEL = dict(seed=11, num_hidden_layers=4)  # the model of `model_dir` (tests/conftest.py)

SETTINGS = {
    "full uniform 1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full uniform 2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full block 3": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
    "selective core_attn": dict(recompute_granularity="selective"),
    "selective core_attn mlp": dict(recompute_granularity="selective", recompute_modules=("core_attn", "mlp")),
    "older switch": dict(recompute_activations=True),
}


def _config(*flags: str, tmp="/tmp/relax-recompute-test"):
    return parse_config([*flags, "--output-dir", tmp])


@pytest.mark.parametrize("flags, words", [
    (["--recompute-granularity", "full"], ["--recompute-method", "--recompute-num-layers"]),
    (["--recompute-granularity", "full", "--recompute-method", "block"], ["--recompute-num-layers"]),
    (["--recompute-method", "uniform"], ["--recompute-method", "--recompute-granularity"]),
    (["--recompute-num-layers", "2"], ["--recompute-num-layers", "--recompute-granularity"]),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"], ["selective", "--recompute-method"]),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], ["--recompute-num-layers"]),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"],
     ["--recompute-num-layers", "0"]),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2",
      "--num-layers", "2", "--pipeline-model-parallel-size", "2", "--resource", '{"actor": [1, 2]}'],
     ["--recompute-num-layers", "(1)"]),  # the embedded default model has 2 layers
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
      "--recompute-modules", "mlp"], ["--recompute-modules", "selective"]),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe_act"], ["moe_act", "--moe-grouped-gemm"]),
    (["--recompute-granularity", "selective", "--recompute-modules", "attn"], ["attn", "core_attn"]),
    # megatron-core 0.16's norm recompute calls Transformer Engine (absent on CPU)
    (["--recompute-granularity", "selective", "--recompute-modules", "layernorm"], ["layernorm", "Transformer Engine"]),
    (["--use-routing-replay", "--recompute-granularity", "selective", "--pipeline-model-parallel-size", "2",
      "--resource", '{"actor": [1, 2]}'], ["routing replay", "--recompute-granularity", "--pipeline-model-parallel"]),
    (["--recompute-activations", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], ["--recompute-activations", "selective"]),
])
def test_refused_combinations_name_the_flags(flags, words):
    with pytest.raises(ConfigError) as err:
        _config(*flags)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_accepted_flags_reach_trainer_settings():
    config = _config("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2")
    assert not unsupported_flags(config)
    s = trainer_settings(config)
    assert (s.recompute_granularity, s.recompute_method, s.recompute_num_layers) == ("full", "block", 2)
    assert trainer_settings(config, forward_only=True).recompute_granularity is None  # no backward to save for
    config = _config("--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp")
    assert not unsupported_flags(config)
    s = trainer_settings(config)
    assert (s.recompute_granularity, s.recompute_method, s.recompute_modules) == ("selective", None,
                                                                                 ("core_attn", "mlp"))
    s = trainer_settings(_config("--recompute-activations"))  # Megatron's shorthand
    assert s.recompute_granularity == "selective" and s.recompute_modules is None


def _step(path, **kw):
    """One train step: (trainer, metrics, gradients by name, weights after the update, layer forward counts)."""
    trainer = hf_trainer(path, **{"lr": 1e-3, "micro_batch_size": 2, "seed": 7, **kw})
    calls = {"layer": 0, "core_attn": 0, "mlp": 0}
    for layer in trainer.gpt_model.decoder.layers:
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__("layer", calls["layer"] + 1))
        layer.self_attention.core_attention.register_forward_pre_hook(
            lambda *_: calls.__setitem__("core_attn", calls["core_attn"] + 1))
        layer.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__("mlp", calls["mlp"] + 1))
    metrics = trainer.train_step(toy_samples(4, seed=3), toy_pg_loss)
    grads = {n: p.main_grad.detach().clone() for n, p in trainer.model.named_parameters()}
    weights = {k: v.clone() for k, v in trainer.export_hf_weights()}
    return trainer, metrics, grads, weights, calls


@pytest.fixture(scope="module")
def plain(model_dir):
    return _step(model_dir)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_recompute_gives_the_same_loss_and_gradients(model_dir, plain, name):
    _, base_metrics, base_grads, base_weights, base_calls = plain
    trainer, metrics, grads, weights, calls = _step(model_dir, **SETTINGS[name])
    cfg = trainer.config
    if name == "older switch":
        assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "uniform", 1)
    else:
        for key, value in SETTINGS[name].items():
            got = getattr(cfg, key)
            assert (tuple(got) if isinstance(value, tuple) else got) == value, key
    for key in ("loss", "grad_norm", "ratio_mean"):
        assert metrics[key] == pytest.approx(base_metrics[key], rel=1e-5, abs=1e-6), key
    assert grads.keys() == base_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], base_grads[n], rtol=1e-5, atol=1e-6, msg=n)
    for k in weights:
        torch.testing.assert_close(weights[k], base_weights[k], rtol=1e-5, atol=1e-6, msg=k)
    # Recompute runs the recomputed parts again in backward: 2 micro-batches x 4 layers without recompute.
    assert base_calls == {"layer": 8, "core_attn": 8, "mlp": 8}
    recomputed = {"full uniform 1": 4, "full uniform 2": 4, "full block 3": 3, "older switch": 4}
    if name in recomputed:
        assert calls["layer"] == 8 + 2 * recomputed[name], calls
    else:
        assert calls["layer"] == 8 and calls["core_attn"] == 16, calls
        assert calls["mlp"] == (16 if "mlp" in SETTINGS[name].get("recompute_modules", ()) else 8), calls


def test_logprob_passes_do_not_recompute(model_dir):
    """Forward-only passes keep nothing for backward: recompute must not change them."""
    samples = toy_samples(3, seed=4)
    base = _step(model_dir)[0].compute_logprobs(samples)
    other = _step(model_dir, recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1)[0].compute_logprobs(samples)
    for a, b in zip(base, other):
        torch.testing.assert_close(a, b)


def test_moe_layers_recompute_to_the_same_result(tmp_path):
    """Selective recompute of the MoE layer (Megatron's "moe" module) on a tiny Qwen3-MoE model."""
    from relax.backends.megatron.testing import build_random_tiny_moe_model

    path = build_random_tiny_moe_model(tmp_path / "moe", seed=2)
    _, base_metrics, base_grads, _, _ = _step(path)
    trainer, metrics, grads, _, _ = _step(path, recompute_granularity="selective", recompute_modules=("moe",))
    assert trainer.config.recompute_modules == ["moe"]
    assert metrics["loss"] == pytest.approx(base_metrics["loss"], rel=1e-5, abs=1e-6)
    for n in grads:
        torch.testing.assert_close(grads[n], base_grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_shared_expert_recompute_gives_the_same_result(tmp_path, model_dir):
    """Selective recompute of a Qwen2-MoE model's gated shared expert (Megatron's "shared_experts" module): the same
    loss and gradients; a model without a shared expert is refused (Megatron would recompute nothing)."""
    from relax.models.tiny import TinyArch, build_tiny_model_dir

    path = build_tiny_model_dir(tmp_path / "qwen2_moe", TinyArch(family="qwen2_moe"), seed=3)
    _, base_metrics, base_grads, _, _ = _step(path)
    trainer, metrics, grads, _, _ = _step(path, recompute_granularity="selective",
                                          recompute_modules=("shared_experts",))
    assert trainer.config.recompute_modules == ["shared_experts"]
    assert metrics["loss"] == pytest.approx(base_metrics["loss"], rel=1e-5, abs=1e-6)
    assert any(".shared_experts." in n for n in grads)
    for n in grads:
        torch.testing.assert_close(grads[n], base_grads[n], rtol=1e-5, atol=1e-6, msg=n)
    # the shared expert runs again in backward: twice per layer and micro-batch (2 layers x 2 micro-batches)
    runs = [0]
    for layer in trainer.gpt_model.decoder.layers:
        layer.mlp.shared_experts.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    trainer.train_step(toy_samples(4, seed=3), toy_pg_loss)
    assert runs[0] == 2 * 2 * 2, runs
    with pytest.raises(ValueError, match="shared expert"):
        _step(model_dir, recompute_granularity="selective", recompute_modules=("shared_experts",))


def test_moe_recompute_of_a_dense_model_is_refused(model_dir):
    with pytest.raises(ValueError, match="dense"):
        _step(model_dir, recompute_granularity="selective", recompute_modules=("moe",))
