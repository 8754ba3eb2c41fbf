"""--optimizer: Megatron builds SGD (with --sgd-momentum) or Adam for the trainer; an SGD step is the plain
momentum update of the gradients; choices the installed Megatron cannot build are refused before Ray."""

import pytest
import torch

from relax.backends.megatron.testing import (
    build_random_tiny_model,
    ensure_single_process,
    hf_trainer,
    toy_pg_loss,
    toy_samples,
)
from relax.config import parse_config
from relax.config.support import unsupported_flags
from relax.roles.megatron_settings import trainer_settings

torch.set_num_threads(1)


def _inner(optimizer):
    """The torch optimizers under Megatron's wrapper(s)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in inner]


def test_sgd_is_built_and_steps_by_the_gradient(tmp_path):
    ensure_single_process()
    path = build_random_tiny_model(tmp_path / "m", "qwen2", seed=3)
    trainer = hf_trainer(path, lr=0.1, micro_batch_size=2, optimizer="sgd", sgd_momentum=0.5, clip_grad=1e9)
    torch_opts = _inner(trainer.optimizer)
    assert all(isinstance(o, torch.optim.SGD) and o.param_groups[0]["momentum"] == 0.5 for o in torch_opts)
    before = {n: p.detach().clone() for n, p in trainer.gpt_model.named_parameters()}
    trainer.train_step(toy_samples(2, seed=1), toy_pg_loss)
    moved = 0
    for name, param in trainer.gpt_model.named_parameters():
        grad = param.main_grad if getattr(param, "main_grad", None) is not None else param.grad
        # first SGD step: the momentum buffer is the gradient itself, so w1 = w0 - lr * g
        torch.testing.assert_close(param.detach(), before[name] - 0.1 * grad, rtol=1e-5, atol=1e-6)
        moved += int(not torch.equal(param.detach(), before[name]))
    assert moved > 0


@pytest.mark.parametrize("choice,refused", [("adam", False), ("sgd", False), ("muon", True), ("lion", True)])
def test_optimizer_choices(tmp_path, choice, refused):
    config = parse_config(["--output-dir", str(tmp_path), "--optimizer", choice, "--sgd-momentum", "0.8"])
    assert (unsupported_flags(config) == [f"--optimizer {choice}"]) is refused
    settings = trainer_settings(config)
    assert settings.optimizer == choice and settings.sgd_momentum == 0.8
