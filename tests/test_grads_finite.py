"""The trainer's check that every gradient is finite before an optimizer step (relax.backends.megatron.optim):
one min/max pass per grad buffer, which must answer exactly as `torch.isfinite(t).all()` does."""

from __future__ import annotations

import pytest
import torch

from relax.backends.megatron.optim import grads_finite, tensor_finite

BAD = (float("nan"), float("inf"), float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("size", [1, 7, 64, 1000, 4099])  # below, at and past the reductions' vector widths
def test_a_single_non_finite_element_anywhere_is_found(dtype, size):
    base = torch.randn(size, generator=torch.Generator().manual_seed(size)).to(dtype)
    assert tensor_finite(base) and bool(torch.isfinite(base).all())
    for position in sorted({0, size // 2, size - 1}):
        for bad in BAD:
            t = base.clone()
            t[position] = bad
            assert not tensor_finite(t), (dtype, size, position, bad)


def test_an_empty_tensor_and_a_multi_dimensional_view_are_checked_like_isfinite():
    assert tensor_finite(torch.empty(0))
    grid = torch.zeros(6, 5)
    view = grid.t()  # not contiguous
    assert tensor_finite(view)
    grid[4, 3] = float("nan")
    assert not tensor_finite(view)


def test_the_model_check_reads_every_parameters_gradient():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model(torch.ones(1, 3)).sum().backward()
    assert grads_finite(model)
    model[1].bias.grad[1] = float("inf")
    assert not grads_finite(model)
