"""token_logprobs / vocab_parallel_entropy against a plain log_softmax (TP=1)."""

import pytest
import torch

from relax.backends.megatron.logprobs import token_logprobs, vocab_parallel_entropy

torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("megatron_process")  # tests/megatron_fixtures.py


def _reference(logits, targets, temperature):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp.float(), ent.float()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_matches_log_softmax(temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, 50, generator=gen) * 3
    targets = torch.randint(0, 50, (3, 11), generator=gen)
    before = logits.clone()
    lp, ent = token_logprobs(logits, targets, temperature=temperature, with_entropy=True)
    ref_lp, ref_ent = _reference(logits, targets, temperature)
    assert torch.equal(logits, before), "input logits must not be modified"
    assert (lp - ref_lp).abs().max() < 1e-5
    assert (ent - ref_ent).abs().max() < 1e-5
    assert (vocab_parallel_entropy(logits / temperature) - ref_ent).abs().max() < 1e-5


def test_chunked_equals_unchunked_values_and_grads():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2, 13, 40, generator=gen)
    targets = torch.randint(0, 40, (2, 13), generator=gen)
    weights = torch.randn(2, 13, generator=gen)
    results = []
    for chunk in (None, 4):
        logits = base.clone().requires_grad_(True)
        lp, ent = token_logprobs(logits, targets, temperature=0.9, with_entropy=True, chunk_size=chunk)
        ((lp * weights).sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), logits.grad.clone()))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    assert torch.allclose(lp0, lp1, atol=1e-6)
    assert torch.allclose(ent0, ent1, atol=1e-6)
    assert torch.allclose(g0, g1, atol=1e-6)
    # gradient agrees with autograd through log_softmax
    logits = base.clone().requires_grad_(True)
    logp = torch.log_softmax(logits / 0.9, -1)
    ref = (logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * weights).sum()
    ref = ref + 0.1 * (-(logp.exp() * logp).sum(-1)).sum()
    ref.backward()
    assert torch.allclose(g0, logits.grad, atol=1e-5)


def test_padded_vocab_entries_are_ignored():
    gen = torch.Generator().manual_seed(2)
    real = torch.randn(1, 5, 30, generator=gen)
    padded = torch.cat([real, torch.full((1, 5, 2), 50.0)], dim=-1)
    targets = torch.randint(0, 30, (1, 5), generator=gen)
    lp, ent = token_logprobs(padded, targets, with_entropy=True, real_vocab_size=30)
    ref_lp, ref_ent = _reference(real, targets, 1.0)
    assert (lp - ref_lp).abs().max() < 1e-5
    assert (ent - ref_ent).abs().max() < 1e-5
    assert torch.isfinite(ent).all()
