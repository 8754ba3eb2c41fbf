"""MoE routing replay for the Megatron trainer (R2, and the trainer half of rollout routing replay R3).

Built on Megatron-core's own `RouterReplay` (`TransformerConfig.moe_enable_routing_replay=True` gives every
`TopKRouter` one). Per router, the action decides how top-k experts are chosen:
  * RECORD: computed from the router logits as usual, and the [tokens, k] indices are kept;
  * REPLAY_FORWARD: taken from the indices we give it; the gates are recomputed from the *current* router
    logits at those experts (so gradients still reach the router), only the choice is frozen;
  * none: the normal top-k.

Megatron records one tensor per forward pass ([S*B, k], token index `s * B + b` of the [S, B] layout the
router sees), but the log-prob pass and the training passes batch samples differently (micro-batch size,
dynamic batching, padding). So routes are kept per sample: a LongTensor [L, n, k] (L = MoE layers of this
pipeline stage in model order, n = the sample's token count, k = top-k). `split_recorded` cuts a micro-batch's
recording into per-sample routes; `pack_targets` builds a micro-batch's replay indices from them (padding
positions get experts 0..k-1; right padding never influences real tokens).

`RouteRecorder` / `RouteReplayer` are the per-micro-batch hooks `MegatronTrainer` calls around each forward
(`before(mb)` / `after(mb)`); they act on this model's routers only (Megatron's class-level instance list
also holds routers of other models built in the same process).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ROUTES_KEY", "RouteRecorder", "RouteReplayer", "model_routers", "pack_targets", "rollout_routes_to_stage",
           "split_recorded", "stage_layers"]

# Sample-dict key of the per-sample routes [L, n, k] that `MegatronTrainer.train_step` replays.
ROUTES_KEY = "routed_experts"


def model_routers(model: torch.nn.Module) -> list:
    """The `RouterReplay` objects of `model`'s MoE routers, in layer order (empty for a dense model or one
    built without `moe_enable_routing_replay`)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m.router_replay for m in model.modules()
            if isinstance(m, TopKRouter) and getattr(m, "router_replay", None) is not None]


def stage_layers(model: torch.nn.Module) -> list[int]:
    """0-based global layer numbers of `model`'s MoE routers with routing replay, in model order (a pipeline
    stage owns a contiguous slice; Megatron's `layer_number` already includes the stage's offset)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [int(m.layer_number) - 1 for m in model.modules()
            if isinstance(m, TopKRouter) and getattr(m, "router_replay", None) is not None]


def rollout_routes_to_stage(routes, layers: Sequence[int], topk: int, num_tokens: int) -> torch.Tensor:
    """Rollout routing replay (R3): the engine's routes of one sample, int [rows, num_layers * k] (SGLang's
    [tokens, layers, k] with layers = the HF model's MoE layers, layer i of HF = layer i of Megatron for the
    supported all-MoE models), as this stage's replay routes [len(layers), min(rows, num_tokens), k].

    rows is normally num_tokens - 1: the final token was sampled but never run through the engine. Missing
    trailing tokens are replayed like padding (experts 0..k-1, `pack_targets`); that is exact for the loss,
    since a causal model's output at position t depends on the routing of positions <= t only, and the last
    position's logits predict nothing that is trained."""
    grid = torch.as_tensor(routes, dtype=torch.long)
    if grid.dim() != 2 or grid.shape[1] % topk:
        raise ValueError(f"rollout routes of shape {tuple(grid.shape)} do not split into top-{topk} experts")
    grid = grid.view(grid.shape[0], -1, topk)[:num_tokens]
    if layers and max(layers) >= grid.shape[1]:
        raise ValueError(f"rollout routes cover {grid.shape[1]} MoE layers; this stage has layers {list(layers)}")
    return grid[:, list(layers)].permute(1, 0, 2).contiguous()


def split_recorded(recorded: Sequence[torch.Tensor], seq_length: int, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Per-sample routes [L, n_b, k] (int64, CPU) from one micro-batch's recordings: one [S*B, k] tensor per
    layer, token (s, b) at row s * B + b; `lengths` are the samples' token counts n_b <= S."""
    batch = len(lengths)
    if not recorded:
        return [torch.zeros((0, int(n), 0), dtype=torch.long) for n in lengths]
    layers = []
    for rec in recorded:
        if rec is None:
            raise RuntimeError("a MoE router recorded nothing in the forward pass (routing replay)")
        if rec.shape[0] != seq_length * batch:
            raise NotImplementedError(
                f"routing replay: a router saw {rec.shape[0]} tokens, expected {seq_length} x {batch} (sequence "
                "parallelism and context parallelism are not supported with routing replay)")
        layers.append(rec.detach().to("cpu", torch.long).view(seq_length, batch, -1))
    stacked = torch.stack(layers)  # [L, S, B, k]
    return [stacked[:, : int(n), b].clone() for b, n in enumerate(lengths)]


def pack_targets(routes: Sequence[torch.Tensor], seq_length: int, topk: int) -> list[torch.Tensor]:
    """Replay indices of one micro-batch: per layer a [S*B, k] int64 tensor (row s * B + b) holding sample b's
    recorded experts at its positions and experts 0..k-1 at padding. `routes[b]` is [L, n_b, k]."""
    if not routes:
        raise ValueError("no samples")
    num_layers = routes[0].shape[0]
    batch = len(routes)
    out = torch.arange(topk, dtype=torch.long).expand(num_layers, seq_length, batch, topk).clone()
    for b, r in enumerate(routes):
        if r.dim() != 3 or r.shape[0] != num_layers or r.shape[2] != topk or r.shape[1] > seq_length:
            raise ValueError(f"sample {b}: routes of shape {tuple(r.shape)} do not fit [{num_layers}, <= "
                             f"{seq_length}, {topk}]")
        out[:, : r.shape[1], b] = r.long()
    return [layer.reshape(seq_length * batch, topk) for layer in out]


def token_lengths(mb) -> list[int]:
    """Each sample's token count in a right-padded `MicroBatch`: its last response token sits at position n - 1,
    predicted by the logits at `logit_index[b, r_b - 1]` = n - 2."""
    return [int(mb.logit_index[b, r - 1]) + 2 for b, r in enumerate(mb.response_lengths)]


class _Hooks:
    def __init__(self, routers: list):
        if not routers:
            raise RuntimeError("routing replay needs an MoE model built with moe_enable_routing_replay")
        self.routers = routers

    def _set(self, action) -> None:
        for r in self.routers:
            r.clear_indices()
            if action is None:
                r.clear_router_replay_action()
            else:
                r.set_router_replay_action(action)

    def __exit__(self, *exc) -> None:
        self._set(None)


class RouteRecorder(_Hooks):
    """Records the routes of every micro-batch's forward pass; `routes` holds them per sample, in order."""

    def __init__(self, routers: list):
        super().__init__(routers)
        self.routes: list[torch.Tensor] = []

    def __enter__(self) -> RouteRecorder:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._set(RouterReplayAction.RECORD)
        return self

    def before(self, mb) -> None:
        for r in self.routers:
            r.clear_indices()

    def after(self, mb) -> None:
        lengths = token_lengths(mb)
        self.routes.extend(split_recorded([r.get_recorded_indices() for r in self.routers], mb.seq_length, lengths))


class RouteReplayer(_Hooks):
    """Replays given per-sample routes: the i-th micro-batch's forward uses the routes of its samples, which are
    the next `mb.size` entries of `routes` (micro-batches are consecutive runs of the samples)."""

    def __init__(self, routers: list, routes: Sequence[torch.Tensor], topk: int):
        super().__init__(routers)
        self.routes = list(routes)
        self.topk = int(topk)
        self._next = 0
        for i, r in enumerate(self.routes):
            if r.shape[0] != len(routers):
                raise ValueError(f"sample {i}: routes for {r.shape[0]} MoE layers, this model (stage) has "
                                 f"{len(routers)}")

    def __enter__(self) -> RouteReplayer:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._set(RouterReplayAction.REPLAY_FORWARD)
        return self

    def before(self, mb) -> None:
        mine = self.routes[self._next:self._next + mb.size]
        if len(mine) != mb.size:
            raise RuntimeError("routing replay: more samples in the micro-batches than routes given")
        self._next += mb.size
        for router, target in zip(self.routers, pack_targets(mine, mb.seq_length, self.topk)):
            # set directly: RouterReplay.set_target_indices also queues it for REPLAY_BACKWARD (unused here)
            router.target_topk_idx = target.to(mb.tokens.device)

    def after(self, mb) -> None:
        return None


def replay_supported(pp: int, recompute: bool, sequence_parallel: bool, cp: int) -> str | None:
    """Why routing replay cannot run with this layout (None if it can)."""
    if sequence_parallel:
        return "routing replay with sequence parallelism is not supported yet"
    if cp > 1:
        return "routing replay with context parallelism is not supported yet"
    if recompute and pp > 1:
        return ("routing replay with activation recomputation and pipeline parallelism is not supported yet "
                "(the backward recompute of a micro-batch would see a later micro-batch's routes)")
    return None
