"""The embedded engine's batched draw of seeded rows picks exactly what one torch.multinomial call per row, with a
generator seeded per row, picks (relax.backends.embedded.sampling._seeded_picks): the sampled tokens of a seeded
request, hence every run's rollouts, do not depend on which of the two computes them."""

import pytest
import torch

from relax.backends.embedded.sampling import SamplingParams, _seeded_picks, sample_batch


def _per_row(probs, seeds):
    return torch.stack([torch.multinomial(p, 1, generator=torch.Generator().manual_seed(s))[0]
                        for p, s in zip(probs, seeds)])


@pytest.mark.parametrize("vocab", [2, 17, 260, 4096])
def test_seeded_picks_equal_per_row_multinomial(vocab):
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(6):
        probs = torch.softmax(3 * torch.randn(48, vocab, generator=gen), -1)
        if trial % 2:  # truncated rows (top-k / top-p leave zeros)
            probs = probs.masked_fill(torch.rand(probs.shape, generator=gen) < 0.7, 0.0)
            probs[:, 0] += 1e-3
        if trial % 3 == 0:
            probs = probs * 5  # multinomial takes unnormalised weights too
        seeds = torch.randint(0, 2**31 - 1, (48,), generator=gen).tolist()
        assert torch.equal(_seeded_picks(probs, seeds), _per_row(probs, seeds))


def test_invalid_rows_raise_as_multinomial_does():
    probs = torch.tensor([[0.5, 0.5], [float("nan"), 1.0]])
    with pytest.raises(RuntimeError):
        _seeded_picks(probs, [1, 2])


def test_sample_batch_mixes_seeded_and_shared_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams.from_dict({"temperature": 0.7, "top_k": 20}) for _ in range(6)]
    seeds = [11, None, 13, None, 15, 16]
    a = sample_batch(logits, params, generator=torch.Generator().manual_seed(1), row_seeds=seeds).tokens
    b = sample_batch(logits, params, generator=torch.Generator().manual_seed(1), row_seeds=seeds).tokens
    assert torch.equal(a, b)
    # a seeded row's pick depends on its own logits and seed only, not on the rows beside it
    alone = sample_batch(logits[2:3], params[2:3], generator=None, row_seeds=[13]).tokens
    assert alone[0] == a[2]
