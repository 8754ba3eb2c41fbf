"""One rollout step of the actor on one rank: samples (+ auxiliary inputs) -> optimizer updates -> metrics.

Plain code on a `MegatronTrainer` (no Ray), called by `relax.roles.trainer.TrainerWorker.train`.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from relax.backends.megatron.routing_replay import rollout_routes_to_stage
from relax.data.balance import dp_shares, strided_shares, token_spread
from relax.data.routes import decode_routes, routes_rows
from relax.data.sample import Sample
from relax.observability.train_dump import save_train_data
from relax.training.advantages import compute_advantages_and_returns, trainer_inputs
from relax.training.objective import PolicyObjective, ValueObjective
from relax.training.train_data import check_true_on_policy, train_samples


def needs_reference(config: Any) -> bool:
    """A reference model is needed for the KL loss term or KL reward shaping."""
    return bool(config.use_kl_loss) or bool(config.kl_coef)


def needs_critic(config: Any) -> bool:
    return config.advantage_estimator == "ppo"


def needs_teacher(config: Any) -> bool:
    return bool(config.use_opd) and config.opd_type == "megatron"


def actor_updates_at(config: Any, step: int) -> bool:
    """False while only the critic trains: --critic-train-only, or the first --num-critic-only-steps steps."""
    return not (config.critic_train_only or step < (config.num_critic_only_steps or 0))


# per-sample rows an auxiliary role sends in `extras`: (rows key, sample-index key, what)
_EXTRA_ROWS = (("ref_logprobs", "ref_sample_index", "reference log-probs"),
               ("values", "values_sample_index", "critic values"),
               ("teacher_logprobs", "teacher_sample_index", "teacher log-probs"))


def check_rows(samples: Sequence[Sample], rows: Sequence[Sequence[float]], index: Sequence[int] | None,
               what: str, step: int) -> None:
    if len(rows) != len(samples):
        raise RuntimeError(f"step {step}: {len(rows)} rows of {what} for {len(samples)} samples")
    if index is not None and list(index) != [s.index for s in samples]:
        raise RuntimeError(f"step {step}: {what} were computed for other samples")
    for row, s in zip(rows, samples):
        if len(row) != len(s.response_tokens):
            raise RuntimeError(f"step {step}: sample {s.index} has {len(s.response_tokens)} response tokens, "
                               f"{what} {len(row)}")


def _check_extras(samples: Sequence[Sample], extras: dict[str, Any], step: int) -> None:
    for key, index_key, what in _EXTRA_ROWS:
        if extras.get(key) is not None:
            check_rows(samples, extras[key], extras.get(index_key), what, step)


def _rows(extras: dict[str, Any], key: str) -> list[torch.Tensor] | None:
    rows = extras.get(key)
    return [torch.tensor(r, dtype=torch.float32) for r in rows] if rows is not None else None


def train_rollout(trainer, samples: Sequence[Sample], config: Any, extras: dict[str, Any] | None = None,
                  step: int = 0) -> dict[str, Any]:
    """Advantages, old/reference log-probs, then `num_updates` optimizer steps on this rank's share.

    `extras` (from relax.core.roles): `ref_logprobs`, `values` (ppo's critic), `teacher_logprobs` (--use-opd),
    each one row per sample. With ppo the result also holds `CRITIC_RETURNS_KEY`: the GAE returns per sample
    (lists of floats, not a metric), which the critic role takes out of the metrics as its targets.
    While only the critic trains (`actor_updates_at` False) advantages and returns are computed but the actor
    makes no update."""

    t0 = time.perf_counter()
    extras = extras or {}
    if not samples:
        raise RuntimeError(f"step {step}: no samples in the data plane")
    _check_extras(samples, extras, step)
    received = len(samples)
    custom_data = bool(config.custom_convert_samples_to_train_data_path or config.custom_reward_post_process_path)
    samples, raw_rewards, rewards, given_advantages = train_samples(samples, config, extras, step)
    objective = PolicyObjective.from_config(config)
    ref_rows = extras.get("ref_logprobs")
    if (objective.needs_ref or config.kl_coef) and ref_rows is None:
        raise RuntimeError(f"step {step}: --use-kl-loss / --kl-coef need reference log-probs, but no reference "
                           "role sent them")
    ref = _rows(extras, "ref_logprobs")
    values = _rows(extras, "values")
    teacher = _rows(extras, "teacher_logprobs")
    if needs_critic(config) and values is None:
        raise RuntimeError(f"step {step}: --advantage-estimator ppo needs the critic's values, but no critic role "
                           "sent them")
    use_opd = bool(config.use_opd)
    if use_opd and teacher is None:
        raise RuntimeError(f"step {step}: --use-opd needs the teacher's log-probs, but no teacher role sent them")
    update_actor = actor_updates_at(config, step)
    layout = trainer.layout
    temperature = config.rollout_temperature
    gbs = config.global_batch_size or len(samples)
    num_updates = max(1, len(samples) // gbs)
    base = trainer_inputs(samples, [0.0] * len(samples))
    routes = rollout_replay_routes(trainer, samples, config, step)
    if routes is not None:  # R3: the old log-probs too are computed with the engine's routing
        for x, r in zip(base, routes):
            x["routed_experts"] = r
    olds, old_entropy, recomputed = _old_logprobs(trainer, base, config, num_updates, step)
    if routes is None:
        routes = _replay_routes(trainer, base, config)
    on_policy_diff = None
    if config.true_on_policy_mode:
        on_policy_diff = check_true_on_policy(samples, recomputed, step)
    if config.disable_compute_advantages_and_returns:
        advantages = given_advantages or [torch.zeros(len(s.response_tokens)) for s in samples]
        returns, adv_metrics = None, {}
    else:
        advantages, returns, adv_metrics = compute_advantages_and_returns(
            samples, config, old_logprobs=olds, ref_logprobs=ref, values=values, teacher_logprobs=teacher,
            rewards=rewards)
    inputs = trainer_inputs(samples, advantages)
    for i, x in enumerate(inputs):
        if olds is not None:
            x["old_logprobs"] = olds[i]
        if ref is not None:
            x["ref_logprobs"] = ref[i]
        if routes is not None:
            x["routed_experts"] = routes[i]
        if old_entropy is not None:
            x["old_entropy"] = old_entropy[i]
    if config.save_debug_train_data:
        save_train_data(config.save_debug_train_data, step, _global_rank(), inputs, [s.index for s in samples])
    metrics: dict[str, list[float]] = {}
    for update in range(num_updates if update_actor else 0):
        batch = inputs[update * gbs:(update + 1) * gbs]
        mine, spread = dp_share(batch, layout, bool(config.balance_data))
        for key, value in spread.items():
            metrics.setdefault(key, []).append(value)
        try:
            out = trainer.train_step(mine, objective, temperature)
        except FloatingPointError as exc:
            raise FloatingPointError(f"step {step} (update {update}): {exc}") from None
        for key in ("loss", "grad_norm"):
            if not math.isfinite(out.get(key, 0.0)):
                raise FloatingPointError(f"step {step} (update {update}): train/{key} is {out[key]}; "
                                         "the update was not applied")
        for key, value in out.items():
            metrics.setdefault(key, []).append(value)
    if config.reset_optimizer_states and update_actor:
        trainer.reset_optimizer_states()
    result: dict[str, Any] = {f"train/{k}": sum(v) / len(v) for k, v in metrics.items()}
    for key, value in adv_metrics.items():
        result[f"train/{key}"] = value
    if "train/kl" not in result and "train/kl_reward" in result:
        result["train/kl"] = result["train/kl_reward"]
    if "ref_seconds" in extras:
        result["perf/ref_logprob_time"] = float(extras["ref_seconds"])
    if "teacher_seconds" in extras:
        result["perf/teacher_logprob_time"] = float(extras["teacher_seconds"])
    if "critic_seconds" in extras:
        result["perf/critic_value_time"] = float(extras["critic_seconds"])
    result["train/num_updates"] = float(num_updates if update_actor else 0)
    result["samples/trained"] = float(received if update_actor else 0)  # sample accounting (relax.observability)
    if custom_data:
        result["train/raw_reward_mean"] = float(raw_rewards.mean())
        if rewards is not None:
            result["train/reward_mean"] = float(rewards.mean())
    if on_policy_diff is not None:
        result["train/true_on_policy_max_abs_diff"] = on_policy_diff
    if values is not None:
        result["train/advantages_mean"] = _masked_mean(advantages, inputs)
    if returns is not None:
        result[CRITIC_RETURNS_KEY] = [r.tolist() for r in returns]
    result["train/tokens"] = float(sum(len(x["tokens"]) for x in inputs))
    result["perf/train_compute_time"] = time.perf_counter() - t0
    return result


def dp_share(batch: Sequence[dict[str, Any]], layout, balance: bool) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """This rank's samples of one update (--balance-data: Karmarkar-Karp on token counts, else strided) and
    the spread of token totals across the data-parallel ranks (max - min): `dp_token_spread` for the assignment
    used, `dp_token_spread_strided` for the default one."""
    lengths = [len(x["tokens"]) for x in batch]
    shares = dp_shares(lengths, layout.dp, balance)
    return [batch[i] for i in shares[layout.dp_rank]], {
        "dp_token_spread": float(token_spread(lengths, shares)[0]),
        "dp_token_spread_strided": float(token_spread(lengths, strided_shares(len(lengths), layout.dp))[0])}


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


CRITIC_RETURNS_KEY = "critic_returns"  # not a metric: the critic role pops it from the actor's result


def _replay_routes(trainer, base: Sequence[dict[str, Any]], config: Any) -> list[torch.Tensor] | None:
    """--use-routing-replay: each sample's MoE routing [L, n, k] under the old policy (the weights of
    the old log-probs: --keep-old-actor's copy, else the current ones), recorded in a forward pass of its own;
    the training passes of this step replay it (relax.backends.megatron.routing_replay)."""
    if not config.use_routing_replay:
        return None
    weights = "old_actor" if config.keep_old_actor else None
    return trainer.compute_logprobs_and_routes(base, config.rollout_temperature, weights=weights)[1]


def rollout_replay_routes(trainer, samples: Sequence[Sample], config: Any, step: int = 0
                          ) -> list[torch.Tensor] | None:
    """--use-rollout-routing-replay (R3): each sample's routes as the rollout engine chose them
    (`Sample.rollout_routed_experts`), as this pipeline stage's replay routes [L, rows, k]
    (`routing_replay.rollout_routes_to_stage`; the final token, never run through the engine, is replayed like
    padding, which cannot change any trained log-prob). A sample without routes, or whose routes stop before a
    token in the loss, stops the step naming it."""
    if not config.use_rollout_routing_replay:
        return None
    layers = trainer.moe_stage_layers()
    topk = trainer.arch.moe_router_topk
    out = []
    for s in samples:
        data = s.rollout_routed_experts
        mask = list(s.loss_mask or [1] * len(s.response_tokens))
        last = max((j for j, m in enumerate(mask) if m), default=-1)
        needed = len(s.prompt_tokens) + last  # positions 0 .. prompt + last - 1 feed the last trained token
        if last < 0:  # nothing of it is trained (e.g. no response): its routing cannot matter
            out.append(torch.zeros((len(layers), 0, topk), dtype=torch.long))
            continue
        if data is None or routes_rows(data) < needed:
            have = "no routed experts" if data is None else f"routed experts for {routes_rows(data)} tokens"
            raise RuntimeError(f"step {step}: --use-rollout-routing-replay: sample {s.index} (group "
                               f"{s.group_index}) has {have}, needs {needed} (prompt {len(s.prompt_tokens)} + "
                               f"response {len(s.response_tokens)} tokens, the last trained one at {last}); its "
                               "generate path did not return the engine's routes for all of them (a custom "
                               "generate function must set Sample.rollout_routed_experts)")
        try:
            out.append(rollout_routes_to_stage(decode_routes(data), layers, topk, s.total_length))
        except ValueError as exc:
            raise RuntimeError(f"step {step}: --use-rollout-routing-replay: sample {s.index}: {exc}") from None
    return out


def _old_logprobs(trainer, base: Sequence[dict[str, Any]], config: Any, num_updates: int, step: int):
    """(old log-probs or None, old entropy or None, the trainer's recomputed log-probs or None), per sample.

    The old policy is the one that generated the samples: the engine's own log-probs with
    --use-rollout-logprobs / --true-on-policy-mode, else recomputed by the trainer (with --keep-old-actor under
    the weights last sent to the engines). They are needed for several updates per step, KL reward shaping,
    OPD and --keep-old-actor; otherwise the loss uses the current log-probs (ratio 1). --use-rollout-entropy
    takes the entropy from the same pass; --true-on-policy-mode always recomputes (to check it)."""
    keep_old = bool(config.keep_old_actor)
    if keep_old and not trainer.has_kept_weights("old_actor"):
        raise RuntimeError(f"step {step}: --keep-old-actor: no copy of the rollout policy's weights was kept")
    weights = "old_actor" if keep_old else None
    engine = bool(config.use_rollout_logprobs or config.true_on_policy_mode)
    wanted = (num_updates > 1 or bool(config.kl_coef) or bool(config.use_opd) or keep_old)
    recompute = config.true_on_policy_mode or config.use_rollout_entropy or (wanted and not engine)
    recomputed = entropy = None
    if recompute:
        if config.use_rollout_entropy:
            recomputed, entropy = trainer.compute_logprobs_and_entropy(base, config.rollout_temperature,
                                                                       weights=weights)
        else:
            recomputed = trainer.compute_logprobs(base, config.rollout_temperature, weights=weights)
    if engine:
        olds = [x["rollout_logprobs"] for x in base]
    else:
        olds = recomputed if wanted else None
    return olds, entropy, recomputed


def _masked_mean(rows: Sequence[torch.Tensor], inputs: Sequence[dict[str, Any]]) -> float:
    total = sum(float((r * (x["loss_mask"] > 0)).sum()) for r, x in zip(rows, inputs))
    count = sum(float((x["loss_mask"] > 0).sum()) for x in inputs)
    return total / max(count, 1.0)


def train_critic(trainer, samples: Sequence[Sample], config: Any, old_values: Sequence[Sequence[float]],
                 returns: Sequence[Sequence[float]], step: int = 0) -> dict[str, float]:
    """The critic's updates of one step on one rank: the value loss (`ValueObjective`) against the GAE returns,
    clipped around `old_values` (the values the advantages were computed with); the same split into
    --global-batch-size updates and data-parallel shares as the actor's. Metrics are `critic/...`."""
    t0 = time.perf_counter()
    if not samples:
        raise RuntimeError(f"step {step}: no samples in the data plane")
    check_rows(samples, old_values, None, "old critic values", step)
    check_rows(samples, returns, None, "critic returns", step)
    objective = ValueObjective.from_config(config)
    inputs = []
    for s, v, r in zip(samples, old_values, returns):
        n = len(s.response_tokens)
        inputs.append({"tokens": torch.tensor(s.prompt_tokens + s.response_tokens, dtype=torch.long),
                       "response_length": n,
                       "loss_mask": torch.tensor(s.loss_mask or [1] * n, dtype=torch.float32),
                       "old_values": torch.tensor(v, dtype=torch.float32),
                       "returns": torch.tensor(r, dtype=torch.float32)})
    gbs = config.global_batch_size or len(samples)
    num_updates = max(1, len(samples) // gbs)
    layout = trainer.layout
    metrics: dict[str, list[float]] = {}
    for update in range(num_updates):
        mine = inputs[update * gbs:(update + 1) * gbs][layout.dp_rank::layout.dp]
        try:
            out = trainer.train_step(mine, objective)
        except FloatingPointError as exc:
            raise FloatingPointError(f"step {step} (critic update {update}): {exc}") from None
        if not math.isfinite(out.get("grad_norm", 0.0)):
            raise FloatingPointError(f"step {step} (critic update {update}): critic/grad_norm is {out['grad_norm']}")
        for key, value in out.items():
            metrics.setdefault(key, []).append(value)
    result = {f"critic/{k}": sum(v) / len(v) for k, v in metrics.items() if k not in ("skipped", "loss_scale")}
    result["critic/returns_mean"] = _masked_mean([x["returns"] for x in inputs], inputs)
    result["critic/old_values_mean"] = _masked_mean([x["old_values"] for x in inputs], inputs)
    result["critic/num_updates"] = float(num_updates)
    result["perf/critic_train_time"] = time.perf_counter() - t0
    return result
