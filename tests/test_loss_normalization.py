"""Loss normalisation of one optimizer step (--calculate-per-token-loss, issue 17 item 1): the objective is the
step's token mean (per-token loss) or sample mean (per-sample loss) whatever the micro-batch split or the
data-parallel layout, for the policy objective and the critic's value loss.

Two levels:
* the arithmetic (`step_shares` + the objectives) in float64 on ragged rows: micro-batch 1, an uneven split,
  the whole step and a two-rank split give the same loss and gradient to 1e-12 relative;
* the real `MegatronTrainer` (a float32 model, so float32 round-off bounds the agreement: 1e-5 relative) with
  fixed micro-batches of 1, an uneven 3/3/1 split, dynamic packing, the whole step, and DP 2 (4 + 3 samples
  in micro-batches 3 + 1 and 3).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relax.formats.model_arch import ModelArch
from relax.backends.megatron.testing import build_random_tiny_model, ensure_single_process, run_ranks, toy_samples
from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings, step_shares
from relax.training.objective import PolicyObjective, ValueObjective

torch.set_num_threads(1)

N = 7  # samples of the step: odd, so splits are uneven


def _policy(per_token: bool) -> PolicyObjective:
    # an entropy bonus and a KL loss term too: every reduced term must be normalised like the policy loss
    return PolicyObjective(estimator="grpo", eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, entropy_coef=0.01,
                           per_token_loss=per_token, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")


def _value(per_token: bool) -> ValueObjective:
    return ValueObjective(value_clip=0.2, per_token_loss=per_token)


# ---------------------------------------------------------------------------------------------------------------
# float64 arithmetic
# ---------------------------------------------------------------------------------------------------------------


def _rows(seed: int = 0):
    """Padded float64 rows of a ragged step: lengths 1..9, masked-out tokens inside, one sample fully masked."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 1, 9, 3, 7, 2, 8]
    T = max(lengths)
    mask = torch.zeros(N, T, dtype=torch.float64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1.0
    mask[2, 4] = mask[4, 0] = 0.0  # e.g. tool tokens
    mask[5] = 0.0  # a sample with no trained token
    rand = lambda: torch.randn(N, T, generator=gen, dtype=torch.float64)
    fields = {"advantages": rand(), "old_logprobs": -rand().abs(), "ref_logprobs": -rand().abs(),
              "old_values": rand(), "returns": rand(), "loss_mask": mask.clone()}
    current = fields["old_logprobs"] + 0.3 * rand()  # ratios away from 1: some tokens clipped
    values = fields["old_values"] + 0.4 * rand()
    entropy = rand().abs()
    return lengths, mask, fields, current, values, entropy


def _split_objective(loss_fn, leaf, entropy, fields, mask, lengths, splits, totals=None):
    """sum over micro-batches of share * micro-batch loss (and the share-weighted metrics), as train_step."""
    bounds, start = [], 0
    for size in splits:
        bounds.append((start, start + size))
        start += size
    masks = [mask[a:b, :max(lengths[a:b])] for a, b in bounds]
    shares = step_shares(masks, totals)
    total, metrics = 0.0, {}
    for (a, b), m, share in zip(bounds, masks, shares):
        width = m.shape[1]
        cut = lambda x: x[a:b, :width]
        loss, report = loss_fn(cut(leaf), None if entropy is None else cut(entropy),
                               {k: cut(v) for k, v in fields.items()}, m)
        total = total + loss * share[loss_fn.loss_weighting]
        for key, value in report.items():
            metrics[key] = metrics.get(key, 0.0) + float(value) * share[loss_fn.metric_weighting(key)]
    return total, metrics


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("kind", ["policy", "value"])
def test_objective_is_independent_of_the_split_float64(kind, per_token):
    lengths, mask, fields, current, values, entropy = _rows()
    loss_fn = _policy(per_token) if kind == "policy" else _value(per_token)
    base = current if kind == "policy" else values
    ent = entropy if kind == "policy" else None
    results = {}
    for name, splits in {"whole": [N], "one": [1] * N, "uneven": [3, 1, 3], "other": [2, 5]}.items():
        leaf = base.clone().requires_grad_(True)
        loss, metrics = _split_objective(loss_fn, leaf, ent, fields, mask, lengths, splits)
        loss.backward()
        results[name] = (loss.detach(), leaf.grad.clone(), metrics)
    # two data-parallel ranks (4 + 3 samples, one and two micro-batches): shares of the whole step
    leaf = base.clone().requires_grad_(True)
    everything = [mask[:2, :max(lengths[:2])], mask[2:4], mask[4:, :max(lengths[4:])]]
    from relax.backends.megatron.trainer import _mask_counts

    totals = _mask_counts(everything)
    rank0, m0 = _split_objective(loss_fn, leaf, ent, fields, mask, lengths, [2, 2], totals)
    rank1, m1 = _split_objective(loss_fn, leaf[4:], None if ent is None else ent[4:],
                                 {k: v[4:] for k, v in fields.items()}, mask[4:], lengths[4:], [3], totals)
    (rank0 + rank1).backward()
    results["dp2"] = ((rank0 + rank1).detach(), leaf.grad.clone(), {k: m0[k] + m1[k] for k in m0})

    # the definition: per-token losses summed over the step / its masked tokens (or per-sample means / samples)
    whole_loss, whole_grad, whole_metrics = results["whole"]
    for name, (loss, grad, metrics) in results.items():
        assert float(loss) == pytest.approx(float(whole_loss), rel=1e-12, abs=1e-15), name
        assert float((grad - whole_grad).abs().max()) <= 1e-12 * float(whole_grad.abs().max()), name
        for key, value in whole_metrics.items():
            assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-15), (name, key)
    if kind == "value":
        from relax import algorithms as alg

        per_tok, met = alg.value_loss(values, fields["old_values"], fields["returns"], mask, value_clip=0.2)
        expected = alg.token_mean(per_tok, mask) if per_token else alg.sample_mean(per_tok, mask)
        assert float(whole_loss) == pytest.approx(float(expected), rel=1e-12)
        assert results["one"][2]["clip_fraction"] == pytest.approx(float(met["clip_fraction"]), rel=1e-12)


def test_old_micro_batch_mean_depends_on_the_split():
    """The test above is sensitive: averaging micro-batch token means (the old fixed-size path) differs."""
    lengths, mask, fields, current, _, entropy = _rows()
    loss_fn = _policy(True)
    whole, _ = _split_objective(loss_fn, current, entropy, fields, mask, lengths, [N])
    means = [loss_fn(current[i:i + 1], entropy[i:i + 1], {k: v[i:i + 1] for k, v in fields.items()},
                     mask[i:i + 1])[0] for i in range(N)]
    assert abs(float(sum(means) / N) - float(whole)) > 1e-3 * abs(float(whole))


# ---------------------------------------------------------------------------------------------------------------
# the real trainer (float32)
# ---------------------------------------------------------------------------------------------------------------

SPLITS = {"whole": dict(micro_batch_size=N), "one": dict(micro_batch_size=1), "uneven": dict(micro_batch_size=3),
          "packed": dict(max_tokens_per_micro_batch=40)}


def _step_samples():
    samples = toy_samples(N, seed=4, min_len=4, max_len=22)
    gen = torch.Generator().manual_seed(8)
    for s in samples:
        n = s["response_length"]
        s["ref_logprobs"] = -torch.rand(n, generator=gen) * 3
        s["old_values"] = torch.randn(n, generator=gen)
        s["returns"] = torch.randn(n, generator=gen)
    return samples


def _trainer(path, value_head: bool):
    from transformers import AutoConfig

    # lr 0 keeps the weights, so every split starts from the same model; no clipping: the raw gradients compare
    settings = TrainerSettings(lr=0.0, clip_grad=0.0, seed=7, value_head=value_head)
    trainer = MegatronTrainer(ModelArch.from_hf_config(AutoConfig.from_pretrained(path)), settings)
    trainer.load_hf(path)
    return trainer


def _runs(path, samples, splits=tuple(SPLITS)):
    """{(kind, per_token, split): (metrics, grads)} of one train_step on `samples` (this rank's share)."""
    out = {}
    for kind in ("policy", "value"):
        trainer = _trainer(path, kind == "value")
        base = trainer.settings
        for per_token in (True, False):
            loss_fn = _policy(per_token) if kind == "policy" else _value(per_token)
            for split in splits:
                settings = SPLITS[split]
                trainer.settings = dataclasses.replace(base, **settings)
                metrics = trainer.train_step(samples, loss_fn)
                grads = {k: p.main_grad.detach().clone() for k, p in trainer.gpt_model.named_parameters()}
                out[(kind, per_token, split)] = (metrics, grads)
    return out


def _dp_worker(rank, world, path, samples):
    from megatron.core import parallel_state as ps

    # 4 + 3 samples; micro-batches of 3 make 3 + 1 on rank 0 and 3 on rank 1 (the other splits: DP 1 only)
    out = _runs(path, samples[rank::world], splits=("uneven",))
    ps.destroy_model_parallel()
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = build_random_tiny_model(tmp_path_factory.mktemp("norm") / "qwen2", "qwen2", seed=5)
    samples = _step_samples()
    dp2 = run_ranks(_dp_worker, 2, str(path), samples, timeout=300)[0]
    ensure_single_process()
    return _runs(path, samples), dp2


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("kind", ["policy", "value"])
def test_trainer_step_is_independent_of_micro_batches_and_dp(trained, kind, per_token):
    dp1, dp2 = trained
    assert (kind, per_token, "uneven") in dp2
    want, want_grads = dp1[(kind, per_token, "whole")]
    scale = max(float(g.abs().max()) for g in want_grads.values())
    assert want["loss"] != 0.0 and scale > 0
    for layout, runs in (("dp1", dp1), ("dp2", dp2)):
        for split in SPLITS:
            if (kind, per_token, split) not in runs:
                continue
            got, grads = runs[(kind, per_token, split)]
            for key in want:
                if key in ("lr", "skipped", "loss_scale"):
                    continue
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (layout, split, key)
            worst = max(float((grads[k] - want_grads[k]).abs().max()) for k in want_grads)
            assert worst <= 1e-5 * scale, (layout, split, worst / scale)
    if kind == "policy":  # the metrics are there and not trivially equal across the tested splits
        assert 0 < want["clip_fraction"] < 1 and want["kl"] != 0 and want["entropy"] > 0
    else:
        assert want["value_loss"] > 0
