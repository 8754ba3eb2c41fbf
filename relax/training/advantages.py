"""Advantages of one rollout step, from its samples' rewards, groups and (optionally) reference log-probs.

Every estimator yields per-token advantages (one tensor per sample, over its response tokens):

* group estimators (grpo, gspo, sapo, cispo) and rloo: one advantage per sample, broadcast over its
  tokens, from the sample's reward; with `--kl-coef` that reward is first shaped per sample,
  `r - kl_coef * sum_t KL_t` (over its masked tokens), and the group normalisation (rloo's leave-one-out
  baseline) acts on the shaped reward (`relax.algorithms.advantages.kl_shaped_rewards`);
* reinforce_plus_plus: discounted return-to-go of KL-penalised token rewards (raw rewards on the last
  token, `-kl_coef * KL_t` on every token);
* reinforce_plus_plus_baseline: the shaped reward `r - kl_coef * sum_t KL_t` minus its group mean,
  broadcast over the tokens;
* ppo: GAE (`--gamma`, `--lambd`) over token rewards (the sample's raw reward on its last token,
  `-kl_coef * KL_t` per token with `--kl-coef`) and the critic's values (`relax.roles.critic`); the
  returns (advantages + values, before whitening) are the critic's regression targets;
* on_policy_distillation (needs --use-opd): pure distillation, the rewards are not used; the reward part of the
  advantage is 0 (plus `-kl_coef * KL_t` return-to-go with `--kl-coef`, a token-level penalty like
  REINFORCE++'s) and the OPD term below is all;
* `--custom-reward-post-process-path` / `--custom-convert-samples-to-train-data-path` give post-processed
  rewards (`rewards=`): the group estimators and rloo use them as the per-sample advantage as given (no group
  normalisation on top; with `--kl-coef` minus `kl_coef * sum_t KL_t`), the other estimators use them in place
  of the raw rewards; `--disable-rewards-normalization` likewise takes the (shaped) reward as the advantage;
* `--normalize-advantages`: masked whitening over all response tokens of the step, with the unbiased (n - 1)
  variance (`relax.algorithms.whiten`, as verl and OpenRLHF);
* `--use-opd` (any estimator): `opd_kl_coef * (log pi_teacher - log pi_rollout)` per token is added
  after whitening (`relax.algorithms.opd_advantages`), the teacher's log-probs from the teacher role.

KL_t (reward shaping) is `kl_estimate(old_logprobs, ref_logprobs, --kl-loss-type)`, the rollout
policy's log-probs (trainer-recomputed, or the engine's with --use-rollout-logprobs) against the
reference model's.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from relax import algorithms as alg
from relax.algorithms import pad_rows
from relax.data.sample import Sample

GROUP_ESTIMATORS = {"grpo", "gspo", "sapo", "cispo"}
DISTILLATION = "on_policy_distillation"
TOKEN_ESTIMATORS = {"reinforce_plus_plus", "reinforce_plus_plus_baseline"}
SUPPORTED = frozenset(GROUP_ESTIMATORS | TOKEN_ESTIMATORS | {"rloo", "ppo", DISTILLATION})


def _response_lengths(samples: Sequence[Sample]) -> torch.Tensor:
    return torch.tensor([len(s.response_tokens) for s in samples], dtype=torch.long)


def _within(lengths: torch.Tensor) -> torch.Tensor:
    """[B, longest] bool: True at the first lengths[b] positions of row b."""
    width = int(lengths.max()) if lengths.numel() else 0
    return torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)


def _split_rows(padded: torch.Tensor, within: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """Row b of `padded`'s first lengths[b] entries, as one tensor per row (views of one flat copy: a clone per
    row of 512 costs more than the step's advantage math)."""
    return list(padded[within].split(lengths.tolist()))


def response_mask(samples: Sequence[Sample]) -> torch.Tensor:
    """[B, longest response] bool: the response tokens the loss counts (the sample's loss mask > 0, else all)."""
    lengths = _response_lengths(samples)
    within = _within(lengths)
    if not any(s.loss_mask for s in samples):
        return within
    masks = [s.loss_mask or [1] * len(s.response_tokens) for s in samples]
    if any(len(m) != len(s.response_tokens) for m, s in zip(masks, samples)):  # as given, padded with zeros
        return pad_rows(masks, within.shape[1]) > 0
    mask = torch.zeros_like(within)
    mask[within] = torch.tensor([v for m in masks for v in m], dtype=torch.float32) > 0
    return mask


def sample_advantages(samples: Sequence[Sample], config: Any, rewards: torch.Tensor | None = None, *,
                      kl_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """One advantage per sample ([B] float32) for the group estimators, rloo and on_policy_distillation (zeros).

    `rewards`: post-processed rewards ([B]), used as given. `kl_penalty` ([B], `--kl-coef` reward shaping):
    `kl_coef * sum_t KL_t` per sample, subtracted from the reward before the group normalisation."""
    est = config.advantage_estimator
    if est == DISTILLATION:
        return torch.zeros(len(samples), dtype=torch.float32)
    given = rewards is not None
    if not given:
        rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if kl_penalty is not None:
        rewards = (rewards.double() - kl_penalty.double()).float()
    if given or config.disable_rewards_normalization:
        return rewards.clone()
    groups = torch.tensor([int(s.group_index) for s in samples], dtype=torch.long)
    if est in GROUP_ESTIMATORS:
        return alg.grpo_advantages(rewards, groups, normalize_std=not config.disable_grpo_std_normalization).float()
    if est == "rloo":
        return alg.rloo_advantages(rewards, groups).float()
    raise ValueError(f"advantage estimator {est!r} has no per-sample advantage")


def compute_advantages(
    samples: Sequence[Sample],
    config: Any,
    *,
    old_logprobs: Sequence[torch.Tensor] | None = None,
    ref_logprobs: Sequence[torch.Tensor] | None = None,
    values: Sequence[torch.Tensor] | None = None,
    teacher_logprobs: Sequence[torch.Tensor] | None = None,
    rewards: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Per-token advantages (one float32 tensor per sample, length = its response) and metrics.

    See `compute_advantages_and_returns` for the inputs."""
    adv, _, metrics = compute_advantages_and_returns(samples, config, old_logprobs=old_logprobs,
                                                     ref_logprobs=ref_logprobs, values=values,
                                                     teacher_logprobs=teacher_logprobs, rewards=rewards)
    return adv, metrics


def compute_advantages_and_returns(
    samples: Sequence[Sample],
    config: Any,
    *,
    old_logprobs: Sequence[torch.Tensor] | None = None,
    ref_logprobs: Sequence[torch.Tensor] | None = None,
    values: Sequence[torch.Tensor] | None = None,
    teacher_logprobs: Sequence[torch.Tensor] | None = None,
    rewards: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, dict[str, float]]:
    """(per-token advantages, per-token returns or None, metrics); one float32 tensor per sample, over its
    response.

    All inputs are per sample, over the response: `old_logprobs` (the rollout policy's) and `ref_logprobs`
    are needed with `--kl-coef`; `values` (the critic's) with `ppo`, which alone yields returns;
    `old_logprobs` and `teacher_logprobs` with `--use-opd`. `rewards` ([B]): post-processed rewards (a custom
    reward post-process or samples-to-train-data function), used as given; default the samples' rewards.
    """
    est = config.advantage_estimator
    if est not in SUPPORTED:
        raise ValueError(f"advantage estimator {est!r} is not wired into the training loop yet")
    lengths = [len(s.response_tokens) for s in samples]
    mask = response_mask(samples)
    width = mask.shape[1]
    metrics: dict[str, float] = {}
    kl = None
    kl_coef = float(config.kl_coef or 0.0)
    if kl_coef:
        if old_logprobs is None or ref_logprobs is None:
            raise ValueError("--kl-coef needs the rollout policy's and the reference model's log-probs")
        kl = alg.kl_estimate(pad_rows(old_logprobs, width), pad_rows(ref_logprobs, width), config.kl_loss_type,
                             mask=mask)
        metrics["kl_reward"] = float(kl.sum() / mask.sum().clamp_min(1))
    post_processed = rewards
    if rewards is None:
        rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.shape != (len(samples),):
        raise ValueError(f"{tuple(rewards.shape)} post-processed rewards for {len(samples)} samples")
    returns = None
    if est == "reinforce_plus_plus":
        adv = alg.reinforce_plus_plus_advantages(rewards, mask, kl=kl, kl_coef=kl_coef, gamma=config.gamma,
                                                 whiten_advantages=False)
    elif est == "ppo":
        if values is None:
            raise ValueError("--advantage-estimator ppo needs the critic's values")
        token_rewards = alg.kl_penalized_token_rewards(rewards, mask, kl=kl, kl_coef=kl_coef)
        adv, returns = alg.gae_advantages(token_rewards, pad_rows(values, width), mask, gamma=config.gamma,
                                          lam=config.lambd)
    elif est == "reinforce_plus_plus_baseline":
        groups = torch.tensor([int(s.group_index) for s in samples], dtype=torch.long)
        adv = alg.reinforce_plus_plus_baseline_advantages(rewards, groups, mask, kl=kl, kl_coef=kl_coef,
                                                          whiten_advantages=False)
    elif est == DISTILLATION and kl is not None:  # no reward: the token-level KL penalty's return-to-go
        shaped = alg.kl_penalized_token_rewards(torch.zeros(len(samples)), mask, kl=kl, kl_coef=kl_coef)
        adv = alg.discounted_returns(shaped, mask, config.gamma)
    else:
        penalty = None
        if kl is not None:  # r - kl_coef * sum_t KL_t, before the group normalisation (kl is 0 outside the mask)
            penalty = kl_coef * kl.double().sum(dim=-1)
        per_sample = sample_advantages(samples, config, post_processed, kl_penalty=penalty)
        adv = alg.broadcast_to_tokens(per_sample, mask)
    if config.normalize_advantages:
        adv = alg.whiten(adv, mask)
    if config.use_opd:
        if old_logprobs is None or teacher_logprobs is None:
            raise ValueError("--use-opd needs the rollout policy's and the teacher's log-probs")
        student, teacher = pad_rows(old_logprobs, width), pad_rows(teacher_logprobs, width)
        adv = adv + alg.opd_advantages(student, teacher, mask, coef=float(config.opd_kl_coef))
        metrics["opd_reverse_kl"] = float(((student - teacher) * mask).sum() / mask.sum().clamp_min(1))
    adv = adv.float()
    counts = torch.tensor(lengths, dtype=torch.long)
    within = _within(counts)
    rows = _split_rows(adv, within, counts)
    ret_rows = _split_rows(returns.float(), within, counts) if returns is not None else None
    return rows, ret_rows, metrics


def trainer_inputs(samples: Sequence[Sample], advantages: Sequence[torch.Tensor] | torch.Tensor) -> list[dict[str, Any]]:
    """`MegatronTrainer` sample dicts: tokens, response_length and per-response-token fields.

    `advantages`: per-token tensors (one per sample) or one value per sample ([B]). Each field of every sample is
    one tensor split into the samples' rows (views): four small tensors per sample cost ~9 ms a step for 512."""
    lengths = [len(s.response_tokens) for s in samples]
    tokens = _flat_rows([s.prompt_tokens + s.response_tokens for s in samples], torch.long)
    masks = _flat_rows([s.loss_mask or [1] * n for s, n in zip(samples, lengths)], torch.float32)
    engine = _flat_rows([s.response_logprobs for s in samples], torch.float32)
    advantage_rows = _advantage_rows(advantages, lengths)
    return [{"tokens": tokens[i], "response_length": n, "advantages": advantage_rows[i], "loss_mask": masks[i],
             "rollout_logprobs": engine[i]} for i, n in enumerate(lengths)]


def _advantage_rows(advantages: Sequence[Any] | torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    if all(not isinstance(a, torch.Tensor) or a.dim() == 0 for a in advantages):  # one value per sample
        values = torch.tensor([float(a) for a in advantages], dtype=torch.float32)
        return list(values.repeat_interleave(torch.tensor(lengths, dtype=torch.long)).split(lengths))
    return [_advantage_row(a, n) for a, n in zip(advantages, lengths)]


def _flat_rows(rows: Sequence[Sequence[float]], dtype: torch.dtype) -> list[torch.Tensor]:
    """One tensor per row, as views of one tensor of them all."""
    return list(torch.tensor([v for row in rows for v in row], dtype=dtype).split([len(row) for row in rows]))


def with_advantages(inputs: Sequence[dict[str, Any]], advantages: Sequence[torch.Tensor] | torch.Tensor
                    ) -> list[dict[str, Any]]:
    """`trainer_inputs` of the same samples with other advantages: copies of `inputs` sharing their tensors
    (building the token tensors again costs ~20 ms a step for 512 samples on CPU)."""
    return [{**x, "advantages": _advantage_row(adv, x["response_length"])} for x, adv in zip(inputs, advantages)]


def _advantage_row(adv: Any, n: int) -> torch.Tensor:
    if not isinstance(adv, torch.Tensor) or adv.dim() == 0:
        return torch.full((n,), float(adv), dtype=torch.float32)
    return adv.float()
