"""Dropout, attention backend and the fp32 switches reach Megatron-core's TransformerConfig / DDP config, and do
what Megatron's flags mean: dropout changes training passes only (log-prob passes stay deterministic)."""

import pytest
import torch

from relax.backends.megatron.testing import hf_trainer, toy_pg_loss, toy_samples
from relax.config import parse_config
from relax.config.errors import ConfigError
from relax.config.rules_recompute import te_available
from relax.config.support import unsupported_flags
from relax.roles.megatron_settings import trainer_settings

torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("megatron_process")  # tests/megatron_fixtures.py
RANDOM_MODEL = dict(seed=13)  # the model of `model_dir` (tests/conftest.py)

# What a Megatron launch script of an RL framework passes (its MISC_ARGS).
SCRIPT_FLAGS = ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
                "--attention-softmax-in-fp32", "--attention-backend", "auto"]


def _config(*flags: str):
    return parse_config([*flags, "--output-dir", "/tmp/relax-precision-test"])


def test_launch_script_flags_are_honoured():
    config = _config(*SCRIPT_FLAGS)
    assert not unsupported_flags(config)
    s = trainer_settings(config)
    assert (s.hidden_dropout, s.attention_dropout, s.attention_backend) == (0.0, 0.0, "auto")


def test_dropout_flags_reach_trainer_settings_and_relax_default_is_zero():
    s = trainer_settings(_config("--hidden-dropout", "0.1", "--attention-dropout", "0.05"))
    assert (s.hidden_dropout, s.attention_dropout) == (0.1, 0.05)
    s = trainer_settings(_config())  # Relax trains without dropout unless asked (Megatron's default is 0.1)
    assert (s.hidden_dropout, s.attention_dropout) == (0.0, 0.0)


@pytest.mark.parametrize("flags, words", [
    (["--hidden-dropout", "1.0"], ["--hidden-dropout", "[0, 1)"]),
    (["--attention-dropout", "-0.1"], ["--attention-dropout"]),
])
def test_bad_dropout_is_refused(flags, words):
    with pytest.raises(ConfigError) as err:
        _config(*flags)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.skipif(te_available(), reason="Transformer Engine on a GPU runs flash and fused attention")
@pytest.mark.parametrize("backend", ["flash", "fused"])
def test_gpu_attention_kernels_fall_back_with_a_warning_without_transformer_engine(backend, caplog):
    """A launch script's --attention-backend flash runs unchanged on CPU: the same attention, Megatron's own."""
    with caplog.at_level("WARNING", logger="relax"):
        config = _config("--attention-backend", backend)
    assert not unsupported_flags(config) and trainer_settings(config).attention_backend == backend
    assert any(f"--attention-backend {backend}" in r.getMessage() and "Megatron's own" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("backend", ["local", "unfused", "auto"])
def test_cpu_attention_backends_are_accepted(backend):
    config = _config("--attention-backend", backend)
    assert not unsupported_flags(config) and trainer_settings(config).attention_backend == backend


def _trainer(path, **kw):
    return hf_trainer(path, **{"lr": 0.0, "micro_batch_size": 2, "seed": 7, **kw})


def test_settings_reach_megatron_configs(model_dir):
    from megatron.core.transformer.enums import AttnBackend

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    trainer = _trainer(model_dir, hidden_dropout=0.2, attention_dropout=0.3, attention_backend="local")
    cfg = trainer.config
    assert (cfg.hidden_dropout, cfg.attention_dropout) == (0.2, 0.3)
    layer = trainer.gpt_model.decoder.layers[0]
    # local: Megatron's own attention (the local layer spec), whether or not Transformer Engine is present. The
    # config field only steers Transformer Engine's kernels, so the local spec keeps Megatron's default there.
    assert type(layer.self_attention.core_attention) is DotProductAttention
    assert cfg.attention_backend == AttnBackend.auto
    assert layer.hidden_dropout == 0.2 and layer.self_attention.core_attention.attention_dropout.p == 0.3
    # --attention-softmax-in-fp32 and --accumulate-allreduce-grads-in-fp32: always on in the trainer
    assert cfg.attention_softmax_in_fp32 and trainer.model.ddp_config.grad_reduce_in_fp32
    assert trainer.gpt_model.decoder.layers[0].self_attention.core_attention.scale_mask_softmax.softmax_in_fp32


@pytest.mark.skipif(te_available(), reason="checks the CPU fallback")
def test_trainer_runs_megatron_attention_for_te_backends_without_transformer_engine(model_dir, caplog):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    samples = toy_samples(3, seed=2)
    with caplog.at_level("WARNING"):
        flash = _trainer(model_dir, attention_backend="flash")
    assert any("flash" in r.getMessage() and "Transformer Engine" in r.getMessage() for r in caplog.records)
    assert type(flash.gpt_model.decoder.layers[0].self_attention.core_attention) is DotProductAttention
    for a, b in zip(flash.compute_logprobs(samples), _trainer(model_dir).compute_logprobs(samples)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dropout_changes_training_passes_not_logprob_passes(model_dir):
    samples = toy_samples(4, seed=8)
    plain = _trainer(model_dir)
    noisy = _trainer(model_dir, hidden_dropout=0.2, attention_dropout=0.2)
    # lr 0: the weights stay, so two steps see the same model; only dropout can tell them apart.
    plain_losses = [plain.train_step(samples, toy_pg_loss)["loss"] for _ in range(2)]
    noisy_losses = [noisy.train_step(samples, toy_pg_loss)["loss"] for _ in range(2)]
    assert plain_losses[0] == plain_losses[1]
    assert noisy_losses[0] != noisy_losses[1] and noisy_losses[0] != plain_losses[0]
    # Log-prob passes run in eval mode: no dropout, the same numbers as the dropout-free trainer, every time.
    first, second, reference = (noisy.compute_logprobs(samples), noisy.compute_logprobs(samples),
                                plain.compute_logprobs(samples))
    for a, b, c in zip(first, second, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c)
