"""--balance-data: the Karmarkar-Karp partition (against brute force and on random cases) and, with two
data-parallel gloo ranks and a per-token loss, that a balanced assignment gives the same update as the strided
one while the token spread across ranks shrinks."""

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from relax.data.balance import dp_shares, karmarkar_karp, strided_shares, token_spread

torch.set_num_threads(1)


def _sums(lengths, parts):
    return [sum(lengths[i] for i in p) for p in parts]


def _check_partition(lengths, parts, k, equal_size=True):
    assert len(parts) == k
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(len(lengths)))  # every sample exactly once
    if equal_size:
        assert {len(p) for p in parts} == {len(lengths) // k}


def _brute_spread(lengths, k):
    """The smallest (max - min) of part sums over all equal-size k-way partitions."""
    n, best = len(lengths), None
    for assign in itertools.product(range(k), repeat=n):
        if any(assign.count(r) != n // k for r in range(k)):
            continue
        sums = [0] * k
        for i, a in enumerate(assign):
            sums[a] += lengths[i]
        best = max(sums) - min(sums) if best is None else min(best, max(sums) - min(sums))
    return best


def test_small_cases_against_brute_force():
    rng = random.Random(0)
    exact = total = 0
    for _ in range(150):
        k = rng.choice([2, 3])
        n = k * rng.randint(1, 3 if k == 2 else 2) + (k if k == 2 else 0)
        lengths = [rng.randint(1, 100) for _ in range(n)]
        parts = karmarkar_karp(lengths, k)
        _check_partition(lengths, parts, k)
        sums = _sums(lengths, parts)
        best = _brute_spread(lengths, k)
        spread = max(sums) - min(sums)
        assert best <= spread <= best + max(lengths) - min(lengths)  # the differencing method's bound
        exact += spread == best
        total += 1
    assert exact / total > 0.7, (exact, total)  # optimal on most small cases


def test_known_optimum():
    lengths = [1, 2, 3, 4, 5, 6, 7, 8]
    parts = karmarkar_karp(lengths, 2)
    assert _sums(lengths, parts) == [18, 18]
    assert karmarkar_karp([10, 10, 1, 1], 2) in ([[0, 2], [1, 3]], [[0, 3], [1, 2]])


def test_random_cases_are_balanced_and_deterministic():
    rng = random.Random(1)
    for _ in range(50):
        k = rng.choice([2, 4, 8])
        n = k * rng.randint(2, 16)
        lengths = [rng.randint(16, 4096) for _ in range(n)]
        parts = karmarkar_karp(lengths, k)
        _check_partition(lengths, parts, k)
        assert parts == karmarkar_karp(list(lengths), k)  # every rank computes the same answer
        balanced, _ = token_spread(lengths, parts)
        strided, _ = token_spread(lengths, strided_shares(n, k))
        assert balanced <= strided
        assert balanced <= max(lengths) - min(lengths)


def test_unequal_sizes_and_defaults():
    lengths = [100, 1, 1, 1, 1, 1]
    parts = karmarkar_karp(lengths, 2, equal_size=False)
    _check_partition(lengths, parts, 2, equal_size=False)
    assert sorted(_sums(lengths, parts)) == [5, 100]
    assert dp_shares(lengths, 2, balance=False) == [[0, 2, 4], [1, 3, 5]]
    assert dp_shares(lengths, 1, balance=True) == [[0, 1, 2, 3, 4, 5]]
    with pytest.raises(ValueError):
        karmarkar_karp([1, 2, 3], 2)


# ---------------------------------------------------------------- two data-parallel ranks


class _TokenMeanLoss:
    """toy_pg_loss with the per-token weighting --calculate-per-token-loss selects."""

    loss_weighting = "tokens"

    def __call__(self, logprobs, entropy, batch, mask):
        from relax.backends.megatron.testing import toy_pg_loss

        return toy_pg_loss(logprobs, entropy, batch, mask)


def _dp_worker(rank, world, path, samples):
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from relax.formats.model_arch import ModelArch
    from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings
    from relax.training.step import dp_share

    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(path))
    out = {}
    for balance in (False, True):
        # adam_eps 1 makes the first Adam step ~ lr * gradient (not its sign), so float noise stays small
        trainer = MegatronTrainer(arch, TrainerSettings(lr=1.0, adam_eps=1.0, micro_batch_size=2, seed=7,
                                                        max_tokens_per_micro_batch=64))
        trainer.load_hf(path)
        mine, spread = dp_share(samples, trainer.layout, balance)
        metrics = trainer.train_step(mine, _TokenMeanLoss())
        out[balance] = {"weights": {k: v.clone() for k, v in trainer.export_hf_weights()},
                        "spread": spread["dp_token_spread"],
                        "loss": metrics["loss"], "mine": [int(s["tokens"].numel()) for s in mine]}
        ps.destroy_model_parallel()
    return out


def test_balanced_and_strided_give_the_same_update_dp2(tmp_path):
    from relax.backends.megatron.testing import build_random_tiny_model, run_ranks, toy_samples

    path = build_random_tiny_model(tmp_path / "qwen2", "qwen2", seed=3)
    samples = sorted(toy_samples(8, seed=4, min_len=4, max_len=30), key=lambda s: s["tokens"].numel())
    lengths = [int(s["tokens"].numel()) for s in samples]
    ranks = run_ranks(_dp_worker, 2, str(path), samples, timeout=300)
    strided, balanced = ranks[0][False], ranks[0][True]
    # the ranks trained on different shares of the same samples
    assert ranks[0][True]["mine"] != ranks[0][False]["mine"]
    assert sum(ranks[0][True]["mine"]) + sum(ranks[1][True]["mine"]) == sum(lengths)
    assert balanced["spread"] < strided["spread"], (balanced["spread"], strided["spread"])
    assert balanced["spread"] == token_spread(lengths, karmarkar_karp(lengths, 2))[0]
    for name, w in strided["weights"].items():
        assert torch.allclose(w, balanced["weights"][name], rtol=1e-5, atol=1e-7), name
        assert torch.equal(w, ranks[1][False]["weights"][name])  # replicas stay identical
    moved = max((strided["weights"][n] - v).abs().max().item() for n, v in _initial(path).items())
    assert moved > 1e-4  # the update is not a no-op
    # (train/loss itself is the mean of micro-batch losses, which depends on the packing; the update does not)


def _initial(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_step_metric_uses_the_config_flag():
    from relax.training.step import dp_share

    batch = [{"tokens": torch.zeros(n)} for n in (1, 2, 3, 10)]
    layout = SimpleNamespace(dp=2, dp_rank=1)
    mine, spread = dp_share(batch, layout, balance=False)
    assert [len(x["tokens"]) for x in mine] == [2, 10]
    assert spread == {"dp_token_spread": 12 - 4, "dp_token_spread_strided": 12 - 4}
    mine, spread = dp_share(batch, layout, balance=True)
    # best equal-size split of 1, 2, 3, 10 is {1, 10} | {2, 3}: spread 11 - 5
    assert spread == {"dp_token_spread": 6, "dp_token_spread_strided": 8}
    assert [len(x["tokens"]) for x in mine] == [2, 3]
