"""From a step's samples to the training data: reward post-processing, custom sample conversion, and the
true-on-policy check.

Reward post-processing (`--custom-reward-post-process-path`): `fn(args, samples) -> (raw_rewards, rewards)`,
two lists of one float per sample (in the samples' order). `rewards` replace the default reward
normalisation: the group estimators (grpo, gspo, sapo, cispo) and rloo take them as the per-sample advantage
as given (no group centring / std scaling on top), the other estimators (reinforce_plus_plus*, ppo) use them
in place of the raw rewards. `raw_rewards` are only reported (train/raw_reward_mean).

Sample conversion (`--custom-convert-samples-to-train-data-path`): `fn(args, samples) -> dict` of per-sample
lists, one entry per sample in the samples' order:

* `tokens` (required): prompt + response token ids;
* `response_lengths` (required): the number of response tokens at the end of `tokens` (>= 1);
* `loss_masks`: per response token, 1 = trained on (default all ones);
* `rewards`: the rewards the advantage estimator uses as given (post-processed, like the reward
  post-processing above; the default normalisation is not applied); required unless
  --disable-compute-advantages-and-returns;
* `advantages`: per response token; only with --disable-compute-advantages-and-returns (default zeros);
* `rollout_log_probs`: the engine's log-probs per response token (default: the sample's own when the
  response length is unchanged; needed when it changed and the engine's log-probs are used);
* `raw_reward`: one float per sample, only reported.

Group indices and sample ids stay those of the samples. The function runs on every trainer rank and must be
deterministic. When auxiliary roles (reference, critic, teacher) scored the samples, the converted tokens must
be the samples' own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch

from relax.config.validate import load_hook
from relax.data.sample import Sample

TRUE_ON_POLICY_ATOL = 1e-4  # float32 trainer vs embedded engine: ~1e-6


def _floats(values: Any, count: int, what: str) -> torch.Tensor:
    out = torch.as_tensor([float(v) for v in values], dtype=torch.float32)
    if out.shape != (count,):
        raise ValueError(f"{what}: {out.numel()} values for {count} samples")
    return out


def post_process_rewards(samples: Sequence[Sample], config: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(raw rewards [B], post-processed rewards [B] or None when the default normalisation applies)."""
    raw = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
    fn = load_hook(config.custom_reward_post_process_path, "--custom-reward-post-process-path")
    if fn is None:
        return raw, None
    out = fn(config, list(samples))
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ValueError("--custom-reward-post-process-path must return (raw_rewards, rewards)")
    return (_floats(out[0], len(samples), "--custom-reward-post-process-path raw_rewards"),
            _floats(out[1], len(samples), "--custom-reward-post-process-path rewards"))


def _uses_engine_logprobs(config: Any) -> bool:
    return bool(config.use_rollout_logprobs or config.use_tis or config.use_opsm or config.get_mismatch_metrics
                or config.true_on_policy_mode)


def convert_samples(samples: Sequence[Sample], config: Any, fn: Callable
                    ) -> tuple[list[Sample], Optional[torch.Tensor], Optional[torch.Tensor], Optional[list[torch.Tensor]]]:
    """Apply a samples-to-train-data function: (samples rebuilt from its dict, raw rewards or None, rewards or
    None, per-token advantages or None). See the module docstring for the dict."""
    flag = "--custom-convert-samples-to-train-data-path"
    data = fn(config, list(samples))
    if not isinstance(data, dict):
        raise ValueError(f"{flag} must return a dict of per-sample lists, got {type(data).__name__}")
    for key in ("tokens", "response_lengths"):
        if key not in data:
            raise ValueError(f"{flag}: the returned dict has no {key!r}")
    count = len(samples)
    for key, value in data.items():
        if isinstance(value, (list, tuple, torch.Tensor)) and len(value) != count:
            raise ValueError(f"{flag}: {key!r} has {len(value)} entries for {count} samples")
    disabled = bool(config.disable_compute_advantages_and_returns)
    if "advantages" in data and not disabled:
        raise ValueError(f"{flag}: 'advantages' are used only with --disable-compute-advantages-and-returns "
                         "(otherwise advantages are computed from 'rewards')")
    if "rewards" not in data and not disabled:
        raise ValueError(f"{flag}: the returned dict needs 'rewards' (or use "
                         "--disable-compute-advantages-and-returns)")
    out, advantages = [], []
    for i, sample in enumerate(samples):
        tokens = [int(t) for t in data["tokens"][i]]
        n = int(data["response_lengths"][i])
        if not 1 <= n < len(tokens):
            raise ValueError(f"{flag}: sample {sample.index}: response length {n} for {len(tokens)} tokens")
        mask = [int(m) for m in data["loss_masks"][i]] if "loss_masks" in data else [1] * n
        if len(mask) != n:
            raise ValueError(f"{flag}: sample {sample.index}: {len(mask)} loss-mask entries, response has {n}")
        if "rollout_log_probs" in data:
            logprobs = [float(x) for x in data["rollout_log_probs"][i]]
        elif n == len(sample.response_tokens):
            logprobs = list(sample.response_logprobs)
        elif _uses_engine_logprobs(config):
            raise ValueError(f"{flag}: sample {sample.index}: the response length changed and the engine's "
                             "log-probs are used; return 'rollout_log_probs'")
        else:
            logprobs = [0.0] * n
        if len(logprobs) != n:
            raise ValueError(f"{flag}: sample {sample.index}: {len(logprobs)} rollout log-probs, response has {n}")
        reward = float(data["rewards"][i]) if "rewards" in data else float(sample.reward)
        out.append(dataclasses.replace(sample, prompt_tokens=tokens[:-n], response_tokens=tokens[-n:],
                                       response_logprobs=logprobs, loss_mask=mask, reward=reward))
        if "advantages" in data:
            row = torch.as_tensor([float(a) for a in data["advantages"][i]], dtype=torch.float32)
            if row.numel() != n:
                raise ValueError(f"{flag}: sample {sample.index}: {row.numel()} advantages, response has {n}")
            advantages.append(row)
    rewards = _floats(data["rewards"], count, f"{flag} rewards") if "rewards" in data else None
    raw = _floats(data["raw_reward"], count, f"{flag} raw_reward") if "raw_reward" in data else None
    return out, raw, rewards, (advantages if "advantages" in data else None)


def scored_by_other_roles(config: Any) -> list[str]:
    """The stage fields other roles compute on the stored samples' tokens: reference log-probs (--use-kl-loss /
    --kl-coef), critic values (ppo), teacher log-probs (--use-opd)."""
    out = []
    if config.use_kl_loss or config.kl_coef:
        out.append("ref_logprobs")
    if config.advantage_estimator == "ppo":
        out.append("values")
    if config.use_opd:
        out.append("teacher_logprobs")
    return out


def train_samples(samples: Sequence[Sample], config: Any, step: int
                  ) -> tuple[list[Sample], torch.Tensor, Optional[torch.Tensor], Optional[list[torch.Tensor]]]:
    """(samples to train on, raw rewards [B], post-processed rewards [B] or None, given advantages or None)."""
    fn = load_hook(config.custom_convert_samples_to_train_data_path, "--custom-convert-samples-to-train-data-path")
    if fn is None:
        raw, rewards = post_process_rewards(samples, config)
        return list(samples), raw, rewards, None
    converted, raw, rewards, advantages = convert_samples(samples, config, fn)
    aux = scored_by_other_roles(config)
    if aux and any(a.tokens != b.tokens for a, b in zip(samples, converted)):
        raise RuntimeError(f"step {step}: --custom-convert-samples-to-train-data-path changed the tokens of samples "
                           f"that auxiliary roles scored ({', '.join(aux)}); keep the tokens")
    if raw is None:
        raw = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
    return converted, raw, rewards, advantages


def check_true_on_policy(samples: Sequence[Sample], trainer_logprobs: Sequence[torch.Tensor], step: int,
                         atol: float = TRUE_ON_POLICY_ATOL) -> float:
    """Max |trainer - engine| log-prob over the trained (loss-mask) response tokens; raises naming the step, the
    sample and the token when it exceeds `atol`."""
    worst = 0.0
    for sample, mine in zip(samples, trainer_logprobs):
        engine = torch.as_tensor(sample.response_logprobs, dtype=torch.float32)
        mine = torch.as_tensor(mine, dtype=torch.float32)
        if engine.numel() != mine.numel():
            raise RuntimeError(f"step {step}: --true-on-policy-mode: sample {sample.index} has {engine.numel()} "
                               f"engine log-probs for {mine.numel()} response tokens")
        mask = torch.as_tensor(sample.loss_mask or [1] * mine.numel()) > 0
        diff = (mine - engine).abs().masked_fill(~mask, 0.0)
        if diff.numel() == 0:
            continue
        token = int(diff.argmax())
        value = float(diff[token])
        if not value <= atol:  # NaN fails too
            raise RuntimeError(
                f"step {step}: --true-on-policy-mode: sample {sample.index} token {token}: the trainer's log-prob "
                f"{float(mine[token]):.6g} differs from the rollout engine's {float(engine[token]):.6g} by "
                f"{value:.3g} > {atol:g}; training is not on-policy (check dtype, temperature and weight sync)")
        worst = max(worst, value)
    return worst
