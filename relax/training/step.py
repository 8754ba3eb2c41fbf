"""One training step of the actor on one rank, as stages over the step's samples (no Ray): actor forward (old
log-probs), advantages, update; and the critic's update.

Plain code on a `MegatronTrainer`, called by the role methods of `relax.roles.trainer.TrainerWorker` (and
`relax.roles.critic.CriticWorker`), which read each stage's inputs from the data plane and write its outputs
back as stage fields (`relax.data.sample.STAGE_FIELDS`); `relax.core.stages` runs them in order.

What a stage computes for the other stages is a per-sample row (old log-probs, advantages, returns). What
stays on the rank between its stages is kept in a `StepBatch`: the samples as trained (after
--custom-convert-samples-to-train-data-path), post-processed rewards, --use-rollout-entropy's entropy and the
routing-replay routes (this pipeline stage's layers only, so not a per-sample field of the data plane).
`train_rollout` runs the three actor stages in process, for tests and single-process use.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from relax.backends.megatron.cpu_compat import native_device_ops
from relax.backends.megatron.routing_replay import rollout_routes_to_stage
from relax.config.old_policy import old_policy_source
from relax.data.balance import dp_shares, strided_shares, token_spread
from relax.data.routes import decode_routes, routes_rows
from relax.data.sample import Sample
from relax.observability.train_dump import save_train_data
from relax.training.advantages import compute_advantages_and_returns, trainer_inputs, with_advantages
from relax.training.objective import PolicyObjective, ValueObjective
from relax.training.train_data import check_true_on_policy, train_samples


def actor_updates_at(config: Any, step: int) -> bool:
    """False while only the critic trains: --critic-train-only, or the first --num-critic-only-steps steps."""
    return not (config.critic_train_only or step < (config.num_critic_only_steps or 0))


def check_rows(samples: Sequence[Sample], rows: Sequence[Sequence[float]], what: str, step: int) -> None:
    if len(rows) != len(samples):
        raise RuntimeError(f"step {step}: {len(rows)} rows of {what} for {len(samples)} samples")
    for row, s in zip(rows, samples):
        if len(row) != len(s.response_tokens):
            raise RuntimeError(f"step {step}: sample {s.index} has {len(s.response_tokens)} response tokens, "
                               f"{what} {len(row)}")


def field_rows(samples: Sequence[Sample], name: str, what: str, step: int) -> list[torch.Tensor] | None:
    """The samples' stage field `name` as float32 tensors, None when no sample has it; checked against the
    response lengths."""
    rows = [getattr(s, name) for s in samples]
    if all(r is None for r in rows):
        return None
    if any(r is None for r in rows):
        raise RuntimeError(f"step {step}: some samples have no {what}")
    check_rows(samples, rows, what, step)
    return [r.float() if isinstance(r, torch.Tensor) else torch.tensor(r, dtype=torch.float32) for r in rows]


@dataclass
class StepBatch:
    """One step's training data on one actor rank, from the forward stage to the update (see the module
    docstring). `fields` lists the stage fields the forward stage wrote (old log-probs, when needed)."""

    step: int
    samples: list[Sample]
    received: int
    raw_rewards: torch.Tensor
    rewards: Optional[torch.Tensor]
    given_advantages: Optional[list[torch.Tensor]]
    custom_data: bool
    num_updates: int
    base: list[dict[str, Any]]
    entropy: Optional[list[torch.Tensor]] = None
    routes: Optional[list[torch.Tensor]] = None
    on_policy_diff: Optional[float] = None
    has_old_logprobs: bool = False
    metrics: dict[str, float] = field(default_factory=dict)  # the advantage stage's, reported with the update
    seconds: float = 0.0  # compute time of this rank's stages so far (perf/train_compute_time)


def forward_stage(trainer, samples: Sequence[Sample], config: Any, step: int = 0, old_elsewhere: bool = False
                  ) -> tuple[StepBatch, Optional[list[torch.Tensor]]]:
    """Actor forward: the training data of the step's samples and their old-policy log-probs (None when the
    loss does not need them; see `_old_logprobs`), with --true-on-policy-mode's check and the routing-replay
    routes. `old_elsewhere`: the update reads old-policy rows computed elsewhere (relax.roles.step_passes): no
    pass here, and None returned."""
    t0 = time.perf_counter()
    if not samples:
        raise RuntimeError(f"step {step}: no samples in the data plane")
    received = len(samples)
    custom_data = bool(config.custom_convert_samples_to_train_data_path or config.custom_reward_post_process_path)
    with native_device_ops():  # host tensors of every sample: no CUDA-to-CPU rewriting (a Python hop per op)
        samples, raw_rewards, rewards, given_advantages = train_samples(samples, config, step)
        base = trainer_inputs(samples, [0.0] * len(samples))
    gbs = config.global_batch_size or len(samples)
    num_updates = max(1, len(samples) // gbs)
    routes = rollout_replay_routes(trainer, samples, config, step)
    if routes is not None:  # R3: the old log-probs too are computed with the engine's routing
        for x, r in zip(base, routes):
            x["routed_experts"] = r
    if old_elsewhere:
        olds = old_entropy = recomputed = None
    else:
        olds, old_entropy, recomputed = _old_logprobs(trainer, base, config, num_updates, step)
    if routes is None:
        routes = _replay_routes(trainer, base, config)
    on_policy_diff = None
    if config.true_on_policy_mode:
        on_policy_diff = check_true_on_policy(samples, recomputed, step)
    batch = StepBatch(step=step, samples=list(samples), received=received, raw_rewards=raw_rewards, rewards=rewards,
                      given_advantages=given_advantages, custom_data=custom_data, num_updates=num_updates, base=base,
                      entropy=old_entropy, routes=routes, on_policy_diff=on_policy_diff,
                      has_old_logprobs=olds is not None or old_elsewhere)
    batch.seconds = time.perf_counter() - t0
    return batch, olds


def advantage_stage(batch: StepBatch, config: Any, *, old_logprobs: Sequence[torch.Tensor] | None = None,
                    ref_logprobs: Sequence[torch.Tensor] | None = None, values: Sequence[torch.Tensor] | None = None,
                    teacher_logprobs: Sequence[torch.Tensor] | None = None
                    ) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]], dict[str, float]]:
    """Advantages: (per-token advantages, per-token returns (ppo) or None, `train/...` metrics), from the
    step's rewards and the other stages' rows (relax.training.advantages)."""
    t0 = time.perf_counter()
    step = batch.step
    # --kl-coef shapes the rewards here; --use-kl-loss's reference rows are the update's (update_stage checks them)
    if config.kl_coef and ref_logprobs is None:
        raise RuntimeError(f"step {step}: --kl-coef needs reference log-probs, but no reference role wrote them")
    if config.advantage_estimator == "ppo" and values is None:
        raise RuntimeError(f"step {step}: --advantage-estimator ppo needs the critic's values, but no critic role "
                           "wrote them")
    if config.use_opd and teacher_logprobs is None:
        raise RuntimeError(f"step {step}: --use-opd needs the teacher's log-probs, but no teacher role wrote them")
    samples = batch.samples
    if config.disable_compute_advantages_and_returns:
        advantages = batch.given_advantages or [torch.zeros(len(s.response_tokens)) for s in samples]
        returns, adv_metrics = None, {}
    else:
        advantages, returns, adv_metrics = compute_advantages_and_returns(
            samples, config, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, values=values,
            teacher_logprobs=teacher_logprobs, rewards=batch.rewards)
    metrics = {f"train/{key}": value for key, value in adv_metrics.items()}
    if values is not None:
        metrics["train/advantages_mean"] = _masked_mean(advantages, batch.base)
    batch.metrics.update(metrics)
    batch.seconds += time.perf_counter() - t0
    return [a.float() for a in advantages], returns, metrics


def update_inputs(batch: StepBatch, advantages: Sequence[torch.Tensor],
                  old_logprobs: Sequence[torch.Tensor] | None = None,
                  ref_logprobs: Sequence[torch.Tensor] | None = None,
                  lo: int = 0, hi: Optional[int] = None) -> list[dict[str, Any]]:
    """The trainer's sample dicts of the update of samples [lo, hi) (default all): the forward stage's tensors of
    the same samples with their advantages, old and reference log-probs, replayed routes and old entropy (those
    the step has). Only rows [lo, hi) are read: later ones may still be on their way (relax.roles.step_passes)."""
    hi = len(batch.base) if hi is None else min(hi, len(batch.base))
    inputs = with_advantages(batch.base[lo:hi], advantages[lo:hi])
    for i, x in zip(range(lo, hi), inputs):
        if old_logprobs is not None and old_logprobs[i] is not None:  # None: the current log-probs (ratio 1)
            x["old_logprobs"] = old_logprobs[i]
        if ref_logprobs is not None:
            x["ref_logprobs"] = ref_logprobs[i]
        if batch.routes is not None:
            x["routed_experts"] = batch.routes[i]
        if batch.entropy is not None:
            x["old_entropy"] = batch.entropy[i]
    return inputs


def update_stage(trainer, batch: StepBatch, config: Any, *, advantages: Sequence[torch.Tensor],
                 old_logprobs: Sequence[torch.Tensor] | None = None,
                 ref_logprobs: Sequence[torch.Tensor] | None = None, late: tuple[str, ...] = ()) -> dict[str, float]:
    """The actor's update: `num_updates` optimizer steps on this rank's share. While only the critic trains
    (`actor_updates_at` False) the actor makes no update. The result merges the advantage stage's metrics
    (`batch.metrics`, on the rank that computed them). `late`: the fields among old_logprobs / ref_logprobs whose
    rows may still be arriving (relax.roles.step_passes): each micro-batch reads them after its forward pass."""
    t0 = time.perf_counter()
    step = batch.step
    objective = PolicyObjective.from_config(config)
    if objective.needs_ref and ref_logprobs is None:
        raise RuntimeError(f"step {step}: --use-kl-loss needs reference log-probs, but no reference role wrote them")
    samples = batch.samples
    update_actor = actor_updates_at(config, step)
    gbs = config.global_batch_size or len(samples)
    num_updates = batch.num_updates
    if config.save_debug_train_data:
        inputs = update_inputs(batch, advantages, old_logprobs, ref_logprobs)
        save_train_data(config.save_debug_train_data, step, _global_rank(), inputs, [s.index for s in samples])
    metrics: dict[str, list[float]] = {}
    given = {"old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs}
    for update in range(num_updates if update_actor else 0):
        lo, hi = update * gbs, (update + 1) * gbs
        part = update_inputs(batch, advantages, *(None if name in late else rows for name, rows in given.items()),
                             lo, hi)
        mine, spread = dp_share(part, trainer.layout, bool(config.balance_data))
        for key, value in spread.items():
            metrics.setdefault(key, []).append(value)
        extra = {"late_fields": _late_fields({n: given[n] for n in late}, part, mine, lo)} if late else {}
        try:
            out = trainer.train_step(mine, objective, config.rollout_temperature, **extra)
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
    result.update(batch.metrics)
    if "train/kl" not in result and "train/kl_reward" in result:
        result["train/kl"] = result["train/kl_reward"]
    result["train/num_updates"] = float(num_updates if update_actor else 0)
    result["samples/trained"] = float(batch.received if update_actor else 0)  # sample accounting
    if batch.custom_data:
        result["train/raw_reward_mean"] = float(batch.raw_rewards.mean())
        if batch.rewards is not None:
            result["train/reward_mean"] = float(batch.rewards.mean())
    if batch.on_policy_diff is not None:
        result["train/true_on_policy_max_abs_diff"] = batch.on_policy_diff
    result["train/tokens"] = float(sum(len(x["tokens"]) for x in batch.base))
    batch.seconds += time.perf_counter() - t0
    result["perf/train_compute_time"] = batch.seconds
    return result


def train_rollout(trainer, samples: Sequence[Sample], config: Any, step: int = 0) -> dict[str, Any]:
    """The actor's three stages of one step in this process: forward, advantages, update. The samples carry
    the other roles' stage fields (`ref_logprobs`, `values`, `teacher_logprobs`), as a read of the data plane
    gives them; like the data plane, each stage's rows are set on the samples (`old_logprobs`, `advantages`,
    `returns`; for converted samples they follow the converted response). Returns the update's metrics."""
    ref = field_rows(samples, "ref_logprobs", "reference log-probs", step)
    values = field_rows(samples, "values", "critic values", step)
    teacher = field_rows(samples, "teacher_logprobs", "teacher log-probs", step)
    batch, olds = forward_stage(trainer, samples, config, step)
    advantages, returns, _ = advantage_stage(batch, config, old_logprobs=olds, ref_logprobs=ref, values=values,
                                             teacher_logprobs=teacher)
    for i, s in enumerate(samples):
        s.old_logprobs = olds[i].tolist() if olds is not None else None
        s.advantages = advantages[i].tolist()
        s.returns = returns[i].tolist() if returns is not None else None
    return update_stage(trainer, batch, config, advantages=advantages, old_logprobs=olds, ref_logprobs=ref)


def _late_fields(rows: dict[str, Sequence[torch.Tensor]], part: Sequence[dict[str, Any]],
                 mine: Sequence[dict[str, Any]], lo: int) -> dict[str, Any]:
    """`MegatronTrainer.train_step`'s late_fields: samples [a, b) of this rank's share `mine` of the update `part`
    (samples lo.. of the step) -> their rows of each field of `rows`, read when asked."""
    where = {id(x): lo + i for i, x in enumerate(part)}
    order = [where[id(x)] for x in mine]
    return {name: (lambda a, b, values=values: [values[i] for i in order[a:b]]) for name, values in rows.items()}


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
    source = old_policy_source(config, num_updates)
    recomputed = entropy = None
    if source.recompute:
        if config.use_rollout_entropy:
            recomputed, entropy = trainer.compute_logprobs_and_entropy(base, config.rollout_temperature,
                                                                       weights=weights)
        else:
            recomputed = trainer.compute_logprobs(base, config.rollout_temperature, weights=weights)
    if source.from_engine:
        olds = [x["rollout_logprobs"] for x in base]
    else:
        olds = recomputed if source.wanted else None
    return olds, entropy, recomputed


def _masked_mean(rows: Sequence[torch.Tensor], inputs: Sequence[dict[str, Any]]) -> float:
    total = sum(float((r * (x["loss_mask"] > 0)).sum()) for r, x in zip(rows, inputs))
    count = sum(float((x["loss_mask"] > 0).sum()) for x in inputs)
    return total / max(count, 1.0)


def train_critic(trainer, samples: Sequence[Sample], config: Any, step: int = 0) -> dict[str, float]:
    """The critic's updates of one step on one rank: the value loss (`ValueObjective`) against the samples' GAE
    `returns`, clipped around their `values` (the values the advantages were computed with); the same split
    into --global-batch-size updates and data-parallel shares as the actor's. Metrics are `critic/...`."""
    t0 = time.perf_counter()
    if not samples:
        raise RuntimeError(f"step {step}: no samples in the data plane")
    old_values = field_rows(samples, "values", "old critic values", step)
    returns = field_rows(samples, "returns", "critic returns", step)
    if old_values is None or returns is None:
        raise RuntimeError(f"step {step}: the critic's update needs the samples' values and GAE returns")
    objective = ValueObjective.from_config(config)
    inputs = []
    for s, v, r in zip(samples, old_values, returns):
        n = len(s.response_tokens)
        inputs.append({"tokens": torch.tensor(s.prompt_tokens + s.response_tokens, dtype=torch.long),
                       "response_length": n,
                       "loss_mask": torch.tensor(s.loss_mask or [1] * n, dtype=torch.float32),
                       "old_values": v, "returns": r})
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
