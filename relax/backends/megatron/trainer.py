"""`MegatronTrainer`: the training engine a trainer role wraps.

One instance per rank. All ranks of the job construct it with the same
arguments and call the same methods in the same order (the methods are
collective). Ranks that share a data-parallel index (the TP/PP/CP peers of a
model replica) must be given the same samples; each data-parallel rank gets its
own samples.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import asdict, replace
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from relax.backends.megatron.settings import TrainerSettings
from relax.backends.megatron.transformer_config import to_transformer_config
from relax.formats.model_arch import ModelArch
from relax.backends.megatron.batching import MicroBatch, add_late_fields, make_micro_batches
from relax.backends.megatron.checkpoint import (
    load_checkpoint,
    load_model_state,
    resolve_model_checkpoint,
    save_checkpoint,
)
from relax.backends.megatron.context_parallel import gather_output, split_input
from relax.backends.megatron.cpu_compat import apply_cpu_compat, compute_device, native_device_ops
from relax.backends.megatron.hf_weights import (
    export_hf_weights,
    load_hf_checkpoint_dir,
    load_hf_weights,
    unwrap_model,
)
from relax.backends.megatron.layer_options import layer_fields, recompute_granularity, uses_te
from relax.backends.megatron.logprobs import token_logprobs
from relax.backends.megatron.megatron_options import (
    apply_process_options,
    after_optimizer_step,
    local_layers,
    model_builders,
    option,
    ddp_fields,
    optimizer_fields,
    parallel_fields,
    require_cuda,
    scheduler_fields,
    transformer_fields,
)
from relax.backends.megatron.model import build_gpt_model
from relax.backends.megatron.optim import build_optimizer, build_scheduler, gather_params, grads_finite, wrap_ddp
from relax.backends.megatron.parallel import ParallelLayout, free_port, init_distributed, init_model_parallel
from relax.backends.megatron import response_positions as positions

__all__ = ["TrainerSettings", "LossFn", "MegatronTrainer", "step_shares"]


def select_frozen(names: Sequence[str], trainable: Sequence[str], frozen: Sequence[str]) -> set[str]:
    """Names of the parameters to freeze: those not matching any `trainable` regex (when given), plus
    those matching a `frozen` regex. Raises if a pattern matches nothing or nothing is left to train."""
    if trainable and frozen:
        raise ValueError("give trainable or frozen parameter patterns, not both")
    for pattern in (*trainable, *frozen):
        if not any(re.search(pattern, n) for n in names):
            raise ValueError(f"parameter pattern {pattern!r} matches no parameter; names look like {names[0]!r}")
    if trainable:
        out = {n for n in names if not any(re.search(p, n) for p in trainable)}
    else:
        out = {n for n in names if any(re.search(p, n) for p in frozen)}
    if len(out) == len(names):
        raise ValueError("the parameter patterns freeze every parameter; nothing is left to train")
    return out


class LossFn(Protocol):
    """The RL loss of one micro-batch.

    Args:
        logprobs: [B, T] float32 log-probs of the response tokens under the
            current policy (tempered); 0 at padding.
        entropy: [B, T] float32 entropy of the tempered distribution, or None
            unless the trainer was asked for it (`needs_entropy`).
        batch: the samples' extra fields, padded: per-token ones [B, T]
            (e.g. `advantages`, `old_logprobs`, `loss_mask`), per-sample scalars [B].
        mask: [B, T] float, 1 on real response tokens (and where `loss_mask` > 0).

    Returns:
        (scalar loss to minimise, metrics: name -> scalar tensor or float).

    The optimised objective is the sum over all micro-batches of all
    data-parallel ranks of the returned loss times the micro-batch's share of
    the step (`step_shares`): of its masked tokens with the attribute
    `loss_weighting = "tokens"`, else of its samples. A loss function may set
    `needs_entropy = True` to receive entropy, and `metric_weighting(name) ->
    "tokens" | "samples"` to weight its metrics otherwise than its loss.
    """

    def __call__(
        self,
        logprobs: torch.Tensor,
        entropy: Optional[torch.Tensor],
        batch: dict[str, torch.Tensor],
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]: ...


def _mask_counts(masks: Sequence[torch.Tensor]) -> list[float]:
    """(masked tokens, samples with a masked token, micro-batches) of the [B, T] masks."""
    return [sum(float(m.sum()) for m in masks), sum(float((m.sum(dim=-1) > 0).sum()) for m in masks),
            float(len(masks))]


def step_shares(masks: Sequence[torch.Tensor], totals: Optional[Sequence[float]] = None) -> list[dict[str, float]]:
    """Each micro-batch's share of an optimizer step (the loss normalisation of `MegatronTrainer.train_step`).

    `masks`: the [B, T] loss masks of some micro-batches of the step; `totals`: (masked tokens, samples with a
    masked token, micro-batches) of the whole step over every data-parallel rank (default: of `masks`).
    Returns per micro-batch {"tokens": its masked tokens / the step's, "samples": its samples with a masked
    token / the step's}; with no masked token (sample) in the step, 1 / the step's micro-batches.
    Sum over the step of share * (micro-batch token mean) = the step's token mean, whatever the split.
    """
    tokens, samples, count = _mask_counts(masks) if totals is None else (float(t) for t in totals)
    out = []
    for t, n, _ in (_mask_counts([m]) for m in masks):
        out.append({"tokens": t / tokens if tokens > 0 else 1.0 / count,
                    "samples": n / samples if samples > 0 else 1.0 / count})
    return out


def _native_step(step_fn, mb: MicroBatch, output: torch.Tensor):
    """A micro-batch's loss (or forward-only result), without the CPU device-rewriting mode (see
    `native_device_ops`)."""
    with native_device_ops():
        return step_fn(mb, output)


class MegatronTrainer:
    """A Megatron-core GPT model with its optimizer, on this rank.

    If torch.distributed is not initialised, a single-process gloo/nccl group
    is created (convenient for one-rank use and tests).
    """

    def __init__(self, arch: ModelArch, settings: TrainerSettings):
        apply_cpu_compat()
        require_cuda(settings.megatron_options)
        if local_layers(settings.megatron_options):  # --spec local / --transformer-impl local
            settings = replace(settings, use_te=False)
        optimizer_call = apply_process_options(settings.megatron_options)  # before the model is built
        if settings.cp > 1 and settings.pp > 1:
            raise NotImplementedError("context parallelism with pipeline parallelism is not supported by "
                                      "MegatronTrainer yet")
        if not dist.is_initialized():
            init_distributed(0, 1, "127.0.0.1", free_port())
        self.settings = settings
        self.layout: ParallelLayout = init_model_parallel(
            settings.tp, settings.pp, settings.cp, settings.ep, settings.etp, seed=settings.seed,
            **parallel_fields(settings.megatron_options),
        )
        if arch.vocab_size % settings.tp:
            arch = arch.with_vocab_multiple(settings.tp)
        self.arch = arch
        self.config = to_transformer_config(
            arch,
            tp=settings.tp,
            pp=settings.pp,
            cp=settings.cp,
            ep=settings.ep,
            etp=settings.etp,
            bf16=settings.bf16,
            fp16=settings.fp16,
            sequence_parallel=settings.sequence_parallel,
            cp_comm_type=("all_gather" if settings.allgather_cp else "p2p") if settings.cp > 1 else None,
            **{"use_cpu_initialization": compute_device().type == "cpu",  # --use-cpu-initialization adds GPUs
               **transformer_fields(settings.megatron_options, arch.is_moe)},
            **layer_fields(settings, uses_te(settings), arch.is_moe, bool(arch.moe_shared_expert_intermediate_size)),
            **self._routing_replay_overrides(arch, settings),
        )
        gpt = build_gpt_model(arch, self.config, uses_te(settings), **model_builders(settings.megatron_options),
                              value_head=settings.value_head,
                              value_head_seed=settings.seed, lora=settings.lora)
        self.frozen_names: set[str] = set()
        if settings.forward_only:
            for param in gpt.parameters():
                param.requires_grad_(False)
        elif settings.trainable_params or settings.frozen_params:
            named = dict(gpt.named_parameters())
            self.frozen_names = select_frozen(list(named), settings.trainable_params, settings.frozen_params)
            for name in self.frozen_names:
                named[name].requires_grad_(False)
        if settings.bf16 or settings.fp16:
            from megatron.core.transformer.module import Float16Module

            gpt = Float16Module(self.config, gpt)  # norms too; logits come out in fp32
        self._device = compute_device()
        self.iteration = 0
        if settings.forward_only:
            self.model = gpt
            self.optimizer = None
            self.scheduler = None
            return
        self.model = wrap_ddp(
            gpt, self.config, use_distributed_optimizer=settings.use_distributed_optimizer,
            **ddp_fields(settings.megatron_options),
        )
        self.optimizer = build_optimizer(
            self.model,
            self.config,
            lr=settings.lr,
            min_lr=settings.min_lr,
            weight_decay=settings.weight_decay,
            adam_beta1=settings.adam_beta1,
            adam_beta2=settings.adam_beta2,
            adam_eps=settings.adam_eps,
            optimizer=settings.optimizer,
            sgd_momentum=settings.sgd_momentum,
            gpu_features=settings.gpu_features,
            clip_grad=settings.clip_grad,
            bf16=settings.bf16,
            fp16=settings.fp16,
            use_distributed_optimizer=settings.use_distributed_optimizer,
            **optimizer_fields(settings.megatron_options),
            **optimizer_call,
        )
        self.scheduler = build_scheduler(
            self.optimizer,
            lr=settings.lr,
            min_lr=settings.min_lr,
            lr_decay_style=settings.lr_decay_style,
            lr_warmup_iters=settings.lr_warmup_iters,
            lr_decay_iters=settings.lr_decay_iters,
            lr_warmup_init=settings.lr_warmup_init,
            weight_decay=settings.weight_decay,
            **scheduler_fields(settings.megatron_options),
        )
        # Megatron's scheduler gives step 0 the warm-up's initial lr; start at step 1
        # so that the first update already uses lr_init + (lr - lr_init) / warmup.
        self.scheduler.step(increment=1)

    @staticmethod
    def _routing_replay_overrides(arch: ModelArch, settings: TrainerSettings) -> dict[str, Any]:
        if not settings.routing_replay:
            return {}
        from relax.backends.megatron.routing_replay import replay_supported

        if not arch.is_moe:
            raise ValueError("routing replay needs an MoE model (this one is dense)")
        why = replay_supported(settings.pp, recompute_granularity(settings) is not None,
                              settings.sequence_parallel and settings.tp > 1, settings.cp)
        if why:
            raise NotImplementedError(why)
        return {"moe_enable_routing_replay": True}

    # ------------------------------------------------------------------ #
    # Weights                                                             #
    # ------------------------------------------------------------------ #

    def load_hf(self, path: str | Path) -> None:
        """Load an HF model folder (safetensors) into this rank's shard."""
        apply_cpu_compat()
        load_hf_weights(self.model, self.arch, load_hf_checkpoint_dir(path))
        self._reload_main_params()

    def load_hf_state_dict(self, state_dict) -> None:
        """Load HF-named tensors (a mapping) into this rank's shard."""
        apply_cpu_compat()
        load_hf_weights(self.model, self.arch, state_dict)
        self._reload_main_params()

    def _reload_main_params(self) -> None:
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def load_weights(self, path: str | Path, step: Optional[int] = None, role: str = "actor") -> str:
        """Load model weights only, from a Relax checkpoint (dir, save root or iter dir holding `<role>`;
        same parallel layout) or an HF folder (a critic takes the body; its value head stays). Returns
        "relax" or "hf"."""
        apply_cpu_compat()
        kind, where = resolve_model_checkpoint(path, step, role=role)
        if kind == "hf":
            self.load_hf(where)
        else:
            load_model_state(where, model=self.model, layout=self.layout)
            self._reload_main_params()
        return kind

    def model_state(self) -> dict[str, Any]:
        """This rank's model shard (CPU tensors), for `set_model_state` of a peer with the same layout."""
        gather_params(self.model)  # --overlap-param-gather: the other ranks' shards of the last step
        state = unwrap_model(self.model).state_dict()
        return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}

    @torch.no_grad()
    def set_model_state(self, state: dict[str, Any]) -> None:
        unwrap_model(self.model).load_state_dict(state, strict=True)
        self._reload_main_params()

    def reset_optimizer_states(self) -> None:
        """Zero the optimizer's moment estimates and step counts (parameters are kept)."""
        from relax.backends.megatron.checkpoint import _sub_optimizers

        for sub in _sub_optimizers(self.optimizer):
            inner = getattr(sub, "optimizer", None)
            if inner is None:
                continue
            for state in inner.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()

    def export_hf_weights(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for this pipeline stage; collective over TP (iterate fully)."""
        apply_cpu_compat()
        gather_params(self.model)
        return export_hf_weights(self.model, self.arch, dtype=dtype)

    # ------------------------------------------------------------------ #
    # Forward / backward                                                  #
    # ------------------------------------------------------------------ #

    def _check_same_samples_in_replica(self, samples: Sequence[dict[str, Any]]) -> None:
        """Raise if the TP/PP/CP peers of this model replica were given different samples."""
        from megatron.core import parallel_state as ps

        if self.layout.world_size == self.layout.dp:
            return
        tokens = [s["tokens"] for s in samples]
        signature = torch.tensor(
            [
                float(len(samples)),
                float(sum(int(t.numel()) for t in tokens)),
                float(sum(int(t.long().sum()) for t in tokens)),
                float(sum(int(s["response_length"]) for s in samples)),
            ],
            dtype=torch.float64,
            device=self._device,
        )
        low, high = signature.clone(), signature.clone()
        group = ps.get_model_parallel_group()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(low, high):
            raise ValueError(
                "ranks of one model replica (same data-parallel rank) got different samples"
            )

    def _micro_batches(self, samples: Sequence[dict[str, Any]], max_tokens: Optional[int] = None) -> list[MicroBatch]:
        if not samples:
            raise ValueError("every rank needs at least one sample")
        self._check_same_samples_in_replica(samples)
        multiple = self.settings.tp if self.config.sequence_parallel else 1
        multiple *= 2 * self.settings.cp if self.settings.cp > 1 else 1  # CP: 2 cp equal chunks (context_parallel)
        with native_device_ops():  # thousands of small tensor ops; `.to(self._device)` names the device itself
            return [
                mb.to(self._device)
                for mb in make_micro_batches(
                    samples,
                    self.settings.micro_batch_size,
                    pad_id=self.settings.pad_token_id,
                    seq_multiple=multiple,
                    max_tokens=max_tokens,
                )
            ]

    def _response_logprobs(
        self, logits: torch.Tensor, mb: MicroBatch, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        logprobs, entropy = token_logprobs(
            positions.at_response_positions(logits, mb),
            mb.targets,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_size=self.settings.logprob_chunk_size,
            real_vocab_size=self.arch.hf_vocab_size,
        )
        valid = torch.arange(mb.targets.shape[1], device=logits.device).unsqueeze(0) < torch.tensor(
            mb.response_lengths, device=logits.device
        ).unsqueeze(1)
        logprobs = logprobs.masked_fill(~valid, 0.0)
        if entropy is not None:
            entropy = entropy.masked_fill(~valid, 0.0)
        return logprobs, entropy

    def _response_values(self, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """[B, R] float32 values of the response tokens' states: the value head's output at the position
        that predicts each response token (the state before it is generated); 0 at padding."""
        values = positions.at_response_positions(output, mb).squeeze(-1).float()
        valid = torch.arange(mb.targets.shape[1], device=values.device).unsqueeze(0) < torch.tensor(
            mb.response_lengths, device=values.device
        ).unsqueeze(1)
        return values.masked_fill(~valid, 0.0)

    def _run(self, micro_batches: list[MicroBatch], step_fn, forward_only: bool, hooks: Any = None) -> list[dict]:
        """`hooks` (routing replay): `hooks.before(mb)` / `hooks.after(mb)` around each micro-batch's forward."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cp = self.settings.cp
        cut = positions.cut_applies(self.gpt_model, sequence_parallel=self.config.sequence_parallel, cp=cp)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if hooks is not None:
                hooks.before(mb)
            with native_device_ops(), positions.response_rows_only(self.gpt_model, mb, cut):
                if cp > 1:  # this rank's chunks in, the whole sequence's output back (context_parallel)
                    output = gather_output(model(split_input(mb.tokens), split_input(mb.position_ids), None))
                else:
                    output = model(mb.tokens, mb.position_ids, None)
            if hooks is not None:
                hooks.after(mb)
            return output, partial(_native_step, step_fn, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.seq_length for mb in micro_batches),
            micro_batch_size=max(mb.size for mb in micro_batches),
            forward_only=forward_only,
        )

    def _broadcast_from_last_stage(self, obj: Any) -> Any:
        from megatron.core import parallel_state as ps

        if self.layout.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(
            box,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
        return box[0]

    @torch.no_grad()
    def compute_logprobs(
        self, samples: Sequence[dict[str, Any]], temperature: float = 1.0, *, weights: Optional[str] = None
    ) -> list[torch.Tensor]:
        """Log-probs (float32, CPU) of each sample's response tokens under the current weights, or under the
        weights kept by `keep_weights(weights)` (the current ones are restored afterwards). Samples that carry
        `routed_experts` (rollout routing replay) are run with those routes replayed."""
        apply_cpu_compat()
        with self.using_kept_weights(weights), self._route_replayer(samples) as replayer:  # R3: samples' routes
            return self._forward_per_response(
                samples, lambda mb, logits: self._response_logprobs(logits, mb, temperature, with_entropy=False)[0],
                hooks=replayer)

    @torch.no_grad()
    def compute_logprobs_and_routes(
        self, samples: Sequence[dict[str, Any]], temperature: float = 1.0, *, weights: Optional[str] = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(log-probs as `compute_logprobs`, routes): routes[i] is sample i's MoE routing in this pass, a LongTensor
        [L, n, k] (this pipeline stage's L MoE layers, its n tokens, top-k experts); give it back as the sample's
        `routed_experts` to `train_step` to replay it (needs `routing_replay`)."""
        from relax.backends.megatron.routing_replay import RouteRecorder, model_routers

        apply_cpu_compat()
        with self.using_kept_weights(weights), RouteRecorder(model_routers(self.gpt_model)) as recorder:
            logprobs = self._forward_per_response(
                samples, lambda mb, logits: self._response_logprobs(logits, mb, temperature, with_entropy=False)[0],
                hooks=recorder)
        return logprobs, recorder.routes

    @torch.no_grad()
    def compute_logprobs_and_entropy(
        self, samples: Sequence[dict[str, Any]], temperature: float = 1.0, *, weights: Optional[str] = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(log-probs, entropies): per sample, float32 CPU rows over its response, from one forward pass; the
        entropy is that of the tempered distribution at each response position."""
        apply_cpu_compat()

        def both(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            logprobs, entropy = self._response_logprobs(logits, mb, temperature, with_entropy=True)
            return torch.stack([logprobs, entropy], dim=-1)

        with self.using_kept_weights(weights), self._route_replayer(samples) as replayer:
            rows = self._forward_per_response(samples, both, hooks=replayer)
        return [r[:, 0].clone() for r in rows], [r[:, 1].clone() for r in rows]

    # Kept weight copies (--keep-old-actor): host copies of this rank's shard, swapped in for forward passes.
    def keep_weights(self, name: str = "old_actor") -> None:
        """Keep a host copy of this rank's current weights under `name` (replacing an earlier one)."""
        if not hasattr(self, "_kept_weights"):
            self._kept_weights: dict[str, dict[str, Any]] = {}
        self._kept_weights[name] = self.model_state()

    def has_kept_weights(self, name: str = "old_actor") -> bool:
        return name in getattr(self, "_kept_weights", {})

    @contextmanager
    def using_kept_weights(self, name: Optional[str]):
        """Within the block the model holds the weights kept as `name` (None: no change); the current weights
        are put back exactly afterwards. Optimizer state and main params are not touched."""
        if name is None:
            yield
            return
        if not self.has_kept_weights(name):
            raise RuntimeError(f"no weights kept as {name!r} (call keep_weights first)")
        model = unwrap_model(self.model)
        current = self.model_state()
        with torch.no_grad():
            model.load_state_dict(self._kept_weights[name], strict=True)
        try:
            yield
        finally:
            with torch.no_grad():
                model.load_state_dict(current, strict=True)

    @torch.no_grad()
    def compute_values(self, samples: Sequence[dict[str, Any]]) -> list[torch.Tensor]:
        """Critic values (float32, CPU) of each sample's response tokens (needs `value_head`)."""
        apply_cpu_compat()
        if not self.settings.value_head:
            raise RuntimeError("compute_values needs a MegatronTrainer built with value_head=True")
        return self._forward_per_response(samples, lambda mb, output: self._response_values(output, mb))

    def _forward_per_response(self, samples: Sequence[dict[str, Any]], per_token,
                              hooks: Any = None) -> list[torch.Tensor]:
        """Forward-only pass; `per_token(mb, output) -> [B, T]` gives one row per sample, cut to its response."""
        budget = self.settings.logprob_max_tokens_per_micro_batch or self.settings.max_tokens_per_micro_batch
        micro_batches = self._micro_batches(samples, budget)

        def step(mb: MicroBatch, output: torch.Tensor):
            return output.new_zeros(()), {"rows": per_token(mb, output).detach().cpu()}

        self.model.eval()
        try:
            outputs = self._run(micro_batches, step, forward_only=True, hooks=hooks)
        finally:
            if not self.settings.forward_only:
                self.model.train()
        result: Optional[list[torch.Tensor]] = None
        if self.layout.is_last_stage:
            with native_device_ops():
                result = [row for out, mb in zip(outputs, micro_batches)
                          for row in positions.response_rows(out["rows"], mb)]
        return self._broadcast_from_last_stage(result)

    def train_step(
        self,
        samples: Sequence[dict[str, Any]],
        loss_fn: LossFn,
        temperature: float = 1.0,
        *,
        with_entropy: Optional[bool] = None,
        late_fields: Optional[dict[str, Any]] = None,
    ) -> dict[str, float]:
        """One optimizer step on this rank's samples; returns metrics averaged over all ranks.
        With `value_head` (a critic) `loss_fn` receives the values [B, T] in place of log-probs (entropy None).
        `late_fields`: per-token fields read when a micro-batch's loss needs them, after its forward pass (rows
        still arriving, relax.roles.step_passes): see `add_late_fields`.

        Metrics: `loss` (the step's objective, see below), `grad_norm`, `lr` (used by this
        update; update k of a warm-up uses lr_init + (lr - lr_init) * k / warmup), `skipped`
        (1.0 when fp16 overflow skipped the update), `loss_scale`, plus what `loss_fn` returns,
        weighted like the loss (below).

        Loss normalisation (--calculate-per-token-loss, Megatron's meaning): the micro-batches are a
        fixed `micro_batch_size` or, with `max_tokens_per_micro_batch` (dynamic batch size), runs of
        samples within a padded-token budget. Either way each micro-batch's loss is weighted by its
        share of the step: of the masked tokens of every micro-batch on every data-parallel rank when
        `loss_fn.loss_weighting == "tokens"`, else of the samples that have a masked token. A token-mean
        loss then gives `sum of per-token losses over the step / masked tokens of the step`, a
        sample-mean loss `sum of per-sample means / samples of the step`: the same objective, gradient
        and `loss` metric whatever the micro-batch size, packing or data-parallel split.
        Metric `m` is weighted by `loss_fn.metric_weighting(m)` ("tokens" or "samples"; default the
        loss's weighting), so a masked-token mean (e.g. a clip fraction) is the step's token mean.

        A non-finite loss or gradient raises `FloatingPointError` on every rank, before the
        optimizer step (the weights are unchanged).
        """
        from megatron.core import parallel_state as ps

        apply_cpu_compat()
        if self.optimizer is None:
            raise RuntimeError("this MegatronTrainer is forward-only")
        if with_entropy is None:
            with_entropy = bool(getattr(loss_fn, "needs_entropy", False))
        micro_batches = self._micro_batches(samples, self.settings.max_tokens_per_micro_batch)
        starts = dict(zip(map(id, micro_batches), accumulate([0] + [mb.size for mb in micro_batches])))
        dp_group = ps.get_data_parallel_group()
        shares = self._step_shares(micro_batches, dp_group)
        loss_weighting = getattr(loss_fn, "loss_weighting", "samples")
        if loss_weighting not in ("tokens", "samples"):
            raise ValueError(f"loss_fn.loss_weighting must be 'tokens' or 'samples', not {loss_weighting!r}")
        metric_weighting = getattr(loss_fn, "metric_weighting", None)
        # Megatron's schedule divides each micro-batch loss by the local micro-batch count and DDP averages the
        # gradients over the DP ranks; this factor undoes both, leaving sum over the step of share * loss.
        undo = len(micro_batches) * self.layout.dp

        def micro_batch_loss(mb: MicroBatch, logits: torch.Tensor):
            if late_fields:
                add_late_fields(mb, late_fields, starts[id(mb)])
            if self.settings.value_head:  # a critic: the loss function gets values [B, R] in place of log-probs
                logprobs, entropy = self._response_values(logits, mb), None
            else:
                logprobs, entropy = self._response_logprobs(logits, mb, temperature, with_entropy)
            return loss_fn(logprobs, entropy, mb.fields, mb.mask)

        def step(mb: MicroBatch, logits: torch.Tensor):
            if self.settings.recompute_loss_function and logits.requires_grad:
                loss, metrics = checkpoint(micro_batch_loss, mb, logits, use_reentrant=False)
            else:
                loss, metrics = micro_batch_loss(mb, logits)
            share = shares[id(mb)]
            report = {"loss": loss.detach().double() * share[loss_weighting]}
            for key, value in metrics.items():
                weighting = metric_weighting(key) if metric_weighting is not None else loss_weighting
                report[key] = torch.as_tensor(value).detach().to(self._device, torch.float64) * share[weighting]
            return loss * (share[loss_weighting] * undo), report

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        with self._route_replayer(samples) as replayer:
            outputs = self._run(micro_batches, step, forward_only=False, hooks=replayer)
        metrics = self._reduce_metrics(outputs, dp_group)
        return self._optimizer_step(metrics)

    def _optimizer_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """Check `metrics`, step optimizer and lr (ChunkedStep too); add grad_norm, lr, skipped, loss_scale."""
        self._check_finite(metrics)
        lr = float(self.optimizer.param_groups[0]["lr"])
        success, grad_norm, _ = self.optimizer.step()
        if success:
            self.scheduler.step(increment=1)
            self.iteration += 1
        after_optimizer_step(self.model, self.iteration, self.settings.megatron_options, success)
        metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), lr=lr,
                       skipped=0.0 if success else 1.0, loss_scale=float(self.optimizer.get_loss_scale().item()))
        return metrics

    def moe_stage_layers(self) -> list[int]:
        """0-based global layer numbers of this pipeline stage's MoE routers (routing replay)."""
        from relax.backends.megatron.routing_replay import stage_layers

        return stage_layers(self.gpt_model)

    @contextmanager
    def _route_replayer(self, samples: Sequence[dict[str, Any]]):
        """Routing replay of the samples' `routed_experts` (all or none of them carry routes)."""
        from relax.backends.megatron.routing_replay import ROUTES_KEY, RouteReplayer, model_routers

        routes = [s.get(ROUTES_KEY) for s in samples]
        if all(r is None for r in routes):
            yield None
            return
        if any(r is None for r in routes) or not self.settings.routing_replay:
            raise ValueError(f"samples carry {ROUTES_KEY!r}: all of them must, and the trainer needs routing_replay")
        with RouteReplayer(model_routers(self.gpt_model), routes, self.arch.moe_router_topk) as replayer:
            yield replayer

    def _check_finite(self, metrics: dict[str, float]) -> None:
        """Raise (on every rank) if the loss or any gradient is NaN/Inf; grads are then zeroed."""
        bad_grad = torch.zeros(1, device=self._device)
        if not (self.settings.fp16):  # fp16 overflow is the loss scaler's job (skipped update)
            bad_grad.fill_(0.0 if grads_finite(self.model) else 1.0)
            if dist.get_world_size() > 1:  # a one-rank all-reduce is a gloo round trip that changes nothing
                dist.all_reduce(bad_grad, op=dist.ReduceOp.MAX)
        loss = metrics.get("loss", 0.0)
        if bad_grad.item() > 0 or loss != loss or loss in (float("inf"), float("-inf")):
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            what = f"train/loss is {loss}" if loss != loss or abs(loss) == float("inf") else \
                f"train/grad_norm is not finite (a gradient holds NaN/Inf; train/loss is {loss})"
            raise FloatingPointError(f"{what}; the update was not applied")

    def _step_shares(self, micro_batches: list[MicroBatch], dp_group) -> dict[int, dict[str, float]]:
        """`step_shares` of this rank's micro-batches (by id) in the step of all DP ranks."""
        masks = [mb.mask for mb in micro_batches]
        totals = torch.tensor(_mask_counts(masks), dtype=torch.float64, device=self._device)
        if dist.get_world_size(dp_group) > 1:  # a one-rank all-reduce is a gloo round trip that changes nothing
            dist.all_reduce(totals, group=dp_group)
        return {id(mb): share for mb, share in zip(micro_batches, step_shares(masks, totals.cpu().tolist()))}

    def _reduce_metrics(self, outputs: list[dict], dp_group) -> dict[str, float]:
        """Sum over all micro-batches of all DP ranks of the (already share-weighted) reports, computed on the
        last stage."""
        result: Optional[dict[str, float]] = None
        if self.layout.is_last_stage:
            keys = sorted(outputs[0])
            sums = torch.stack([sum(out[k].double() for out in outputs) for k in keys]).to(self._device)
            if dist.get_world_size(dp_group) > 1:
                dist.all_reduce(sums, group=dp_group)
            result = {k: float(v) for k, v in zip(keys, sums.cpu())}
        return self._broadcast_from_last_stage(result)

    # ------------------------------------------------------------------ #
    # Checkpoints                                                         #
    # ------------------------------------------------------------------ #

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write model, optimizer, scheduler and RNG state (collective, atomic)."""
        apply_cpu_compat()
        gather_params(self.model)
        return save_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            iteration=self.iteration,
            layout=self.layout,
            extra_meta={"arch": asdict(self.arch), "settings": asdict(self.settings)},
            save_rng=not option(self.settings.megatron_options, "no_save_rng", False),
        )

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore state written by `save_checkpoint`; returns the iteration."""
        apply_cpu_compat()
        if self.optimizer is None:
            self.iteration = load_model_state(path, model=self.model, layout=self.layout)
            return self.iteration
        self.iteration = load_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            layout=self.layout,
            load_rng=not option(self.settings.megatron_options, "no_load_rng", False),
        )
        return self.iteration

    @property
    def gpt_model(self) -> torch.nn.Module:
        """The underlying `GPTModel` (unwrapped from DDP)."""
        return unwrap_model(self.model)
