"""MoE routing replay (--use-routing-replay) on a tiny Qwen3-MoE, one gloo rank:

* per-sample routes survive re-batching (split_recorded / pack_targets are inverse on real positions);
* recording does not change the log-probs; replaying the recorded routes with unchanged weights gives the same
  loss and gradient norm as no replay (lr 0, so nothing moves);
* after the router weights change so much that fresh top-k choices flip, the training pass with replay routes
  every token to exactly the recorded experts, with gates = softmax of the *current* router logits over those
  experts; without replay the experts differ;
* train_rollout with --use-routing-replay records in its own pass and the training passes replay it;
* the parse rule (routing replay needs an MoE model) and the support set.
"""

import json
import math

import pytest
import torch

from relax.formats.model_arch import ModelArch
from relax.backends.megatron.batching import make_micro_batches
from relax.backends.megatron.routing_replay import (
    ROUTES_KEY,
    model_routers,
    pack_targets,
    split_recorded,
    token_lengths,
)
from relax.backends.megatron.testing import (
    build_random_tiny_moe_model,
    ensure_single_process,
    toy_pg_loss,
    toy_samples,
)
from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings

torch.set_num_threads(1)
TOPK = 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_random_tiny_moe_model(tmp_path_factory.mktemp("rr") / "qwen3moe", seed=7)


@pytest.fixture(scope="module")
def trainer(moe_dir):
    from transformers import AutoConfig

    ensure_single_process()
    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(moe_dir))
    t = MegatronTrainer(arch, TrainerSettings(lr=0.0, micro_batch_size=2, seed=3, routing_replay=True))
    t.load_hf(moe_dir)
    return t


def _routers(trainer):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in trainer.gpt_model.modules() if isinstance(m, TopKRouter)]


class _Spy:
    """Forward hooks on the routers: per call, the routing map [N, E], probs [N, E] and the router's input."""

    def __init__(self, routers):
        self.calls: list[list[tuple]] = [[] for _ in routers]
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer):
        def hook(module, args, output):
            probs, routing_map = output
            self.calls[layer].append((routing_map.detach().clone(), probs.detach().clone(), args[0].detach().clone()))
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def _experts_per_token(routing_map: torch.Tensor, seq: int, batch: int) -> torch.Tensor:
    """[S, B, k] sorted expert ids from a [S*B, E] routing map."""
    idx = routing_map.nonzero()  # rows in order
    experts = idx[:, 1].view(seq * batch, TOPK)
    return experts.sort(dim=-1).values.view(seq, batch, TOPK)


def test_split_and_pack_are_inverse_on_real_positions():
    gen = torch.Generator().manual_seed(0)
    lengths, seq, layers = [5, 3, 7], 7, 3
    recorded = [torch.randint(0, 8, (seq * len(lengths), TOPK), generator=gen) for _ in range(layers)]
    routes = split_recorded(recorded, seq, lengths)
    assert [tuple(r.shape) for r in routes] == [(layers, n, TOPK) for n in lengths]
    assert torch.equal(routes[1][2, 1], recorded[2][1 * 3 + 1])  # layer 2, token s=1 of sample b=1: row s*B+b
    # re-batched: samples 2 and 0 in a micro-batch of length 9
    packed = pack_targets([routes[2], routes[0]], 9, TOPK)
    for layer in range(layers):
        grid = packed[layer].view(9, 2, TOPK)
        assert torch.equal(grid[:7, 0], routes[2][layer]) and torch.equal(grid[:5, 1], routes[0][layer])
        assert torch.equal(grid[7:, 0], torch.arange(TOPK).expand(2, TOPK))  # padding: experts 0..k-1
    with pytest.raises(ValueError):
        pack_targets([routes[2]], 6, TOPK)  # longer than the micro-batch
    with pytest.raises(NotImplementedError):
        split_recorded([recorded[0][:-1]], seq, lengths)  # e.g. a sequence-parallel shard


def test_token_lengths_of_micro_batches():
    samples = toy_samples(3, seed=1)
    (mb,) = make_micro_batches(samples, 4)
    assert token_lengths(mb) == [int(s["tokens"].numel()) for s in samples]


def test_record_then_replay_is_identity_when_nothing_changed(trainer):
    samples = toy_samples(4, seed=5, vocab=320)
    plain = trainer.compute_logprobs(samples)
    logprobs, routes = trainer.compute_logprobs_and_routes(samples)
    assert all(torch.equal(a, b) for a, b in zip(plain, logprobs))
    assert len(model_routers(trainer.gpt_model)) == 2
    for s, r in zip(samples, routes):
        assert tuple(r.shape) == (2, s["tokens"].numel(), TOPK) and 0 <= int(r.min()) and int(r.max()) < 4
        assert all(len(set(row.tolist())) == TOPK for row in r.reshape(-1, TOPK))  # k distinct experts
    # Re-batched differently for training (micro-batch 2 vs the whole list above): same routes, same loss.
    without = trainer.train_step(samples, toy_pg_loss)
    with_replay = trainer.train_step([{**s, ROUTES_KEY: r} for s, r in zip(samples, routes)], toy_pg_loss)
    assert with_replay["loss"] == pytest.approx(without["loss"], abs=1e-6)
    assert with_replay["grad_norm"] == pytest.approx(without["grad_norm"], rel=1e-5)
    for r in model_routers(trainer.gpt_model):  # replay switched off again afterwards
        assert r.router_replay_action is None and r.target_topk_idx is None


def test_replay_keeps_recorded_experts_after_router_change(trainer):
    samples = toy_samples(4, seed=9, vocab=320)
    _, routes = trainer.compute_logprobs_and_routes(samples)
    routers = _routers(trainer)
    saved = [r.weight.detach().clone() for r in routers]
    gen = torch.Generator().manual_seed(11)
    try:
        with torch.no_grad():  # a new router: fresh top-k choices flip for many tokens
            for r in routers:
                r.weight.copy_(torch.randn(r.weight.shape, generator=gen) * 3.0)
        replayed = [{**s, ROUTES_KEY: r} for s, r in zip(samples, routes)]
        spy = _Spy(routers)
        try:
            out_replay = trainer.train_step(replayed, toy_pg_loss)
            replay_calls = [list(c) for c in spy.calls]
            spy.calls = [[] for _ in routers]
            out_fresh = trainer.train_step(samples, toy_pg_loss)
            fresh_calls = spy.calls
        finally:
            spy.close()
        flipped = 0
        for layer in range(len(routers)):
            # micro-batches of 2 samples, in order
            for m, (start, stop) in enumerate(((0, 2), (2, 4))):
                group = samples[start:stop]
                seq = max(int(s["tokens"].numel()) for s in group)
                rmap, probs, hidden = replay_calls[layer][m]
                got = _experts_per_token(rmap, seq, len(group))
                fresh = _experts_per_token(fresh_calls[layer][m][0], seq, len(group))
                logits = routers[layer].gating(hidden).view(seq * len(group), -1)
                for b, s in enumerate(group):
                    n = int(s["tokens"].numel())
                    want = routes[start + b][layer].sort(dim=-1).values
                    assert torch.equal(got[:n, b], want)  # the recorded experts, not the new router's choice
                    flipped += int((fresh[:n, b] != want).any(dim=-1).sum())
                    # gates: softmax of the current logits over the replayed experts (norm_topk_prob)
                    rows = torch.arange(n) * len(group) + b
                    picked = routes[start + b][layer]
                    expect = torch.softmax(logits[rows].gather(1, picked), dim=-1)
                    assert torch.allclose(probs[rows].gather(1, picked), expect, atol=1e-6)
        assert flipped > 10, flipped  # the case is real: without replay many tokens go elsewhere
        assert abs(out_replay["loss"] - out_fresh["loss"]) > 1e-6
    finally:
        with torch.no_grad():
            for r, w in zip(routers, saved):
                r.weight.copy_(w)


def test_train_rollout_records_and_replays(trainer, moe_dir, tmp_path):
    from relax.config import parse_config
    from relax.data.sample import Sample
    from relax.training.step import train_rollout

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "1+1=", "label": "2"}\n')
    config = parse_config(["--hf-checkpoint", str(moe_dir), "--prompt-data", str(prompts), "--use-routing-replay",
                           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "2",
                           "--micro-batch-size", "1", "--num-rollout", "1", "--output-dir", str(tmp_path / "out")])
    gen = torch.Generator().manual_seed(3)
    samples = []
    for i in range(4):
        prompt = torch.randint(0, 320, (5 + i,), generator=gen).tolist()
        response = torch.randint(0, 320, (3 + i,), generator=gen).tolist()
        samples.append(Sample(index=i, group_index=i // 2, prompt_tokens=prompt, response_tokens=response,
                              response_logprobs=[-1.0] * len(response), reward=float(i % 2)))
    recorded, seen = [], []
    original = trainer.compute_logprobs_and_routes
    original_step = trainer.train_step

    def record(*a, **k):
        out = original(*a, **k)
        recorded.extend(out[1])
        return out

    def step(batch, *a, **k):
        seen.extend(x.get(ROUTES_KEY) for x in batch)
        return original_step(batch, *a, **k)

    trainer.compute_logprobs_and_routes, trainer.train_step = record, step
    try:
        result = train_rollout(trainer, samples, config, step=0)
    finally:
        del trainer.compute_logprobs_and_routes, trainer.train_step
    assert result["train/num_updates"] == 2.0 and result["train/loss"] == result["train/loss"]
    assert len(recorded) == 4 and len(seen) == 4 and all(r is not None for r in seen)
    assert all(torch.equal(a, b) for a, b in zip(recorded, seen))


def test_parse_rule_and_support(moe_dir, tmp_path):
    from transformers import AutoConfig

    from relax.config import parse_config
    from relax.config.errors import ConfigError
    from relax.config.support import unsupported_flags
    from relax.models.tiny import TinyArch, build_tiny_model_dir
    from relax.roles.megatron_settings import trainer_settings

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "1+1=", "label": "2"}\n')
    base = ["--prompt-data", str(prompts), "--num-rollout", "1", "--rollout-batch-size", "1",
            "--output-dir", str(tmp_path / "out")]
    config = parse_config(["--hf-checkpoint", str(moe_dir), "--use-routing-replay", *base])
    assert unsupported_flags(config) == []
    assert trainer_settings(config).routing_replay and not trainer_settings(config, forward_only=True).routing_replay
    dense = build_tiny_model_dir(tmp_path / "dense", TinyArch(family="qwen2"), seed=0)
    assert "num_experts" not in json.loads((dense / "config.json").read_text())
    with pytest.raises(ConfigError, match="--use-routing-replay"):
        parse_config(["--hf-checkpoint", str(dense), "--use-routing-replay", *base])
    with pytest.raises(ConfigError, match="--use-rollout-routing-replay"):
        parse_config(["--hf-checkpoint", str(dense), "--use-rollout-routing-replay", *base])
    assert AutoConfig.from_pretrained(moe_dir).num_experts == 4


@pytest.mark.e2e
def test_routing_replay_end_to_end(tmp_path):
    """Through the controller (real Ray, Megatron over gloo, an embedded engine running the HF Qwen3-MoE,
    TransferQueue): 2 steps of 2 updates each with --use-routing-replay; the actor records routes in its own pass
    and replays them (a trainer without routing_replay would refuse the routes, so the run proves the wiring).
    The weights reach the engine after each step (per-expert names into transformers' fused expert tensors)."""
    from relax.config import parse_config
    from conftest import run_steps
    from relax.models.tasks import generate_task_dataset
    from relax.models.tiny import build_byte_tokenizer

    model = build_random_tiny_moe_model(tmp_path / "moe", seed=2)
    tok = build_byte_tokenizer()
    tok.save_pretrained(model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    (model / "config.json").write_text(json.dumps(cfg))
    data = generate_task_dataset(tmp_path / "train.jsonl", 16, seed=0, task="add_mod10")
    out = tmp_path / "run"
    config = parse_config(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--apply-chat-template",
                           "--input-key", "input", "--label-key", "label", "--rm-type", "random",
                           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "2",
                           "--rollout-max-response-len", "4", "--micro-batch-size", "1", "--lr", "1e-2",
                           "--num-rollout", "2", "--resource", '{"actor": [1, 1], "rollout": [1, 1]}',
                           "--num-data-storage-units", "1", "--output-dir", str(out), "--distributed-backend", "gloo",
                           "--use-routing-replay",
                           # every step's push goes to the engine's fused expert tensors by per-expert HF names,
                           # and is read back tensor by tensor
                           "--check-weight-update-equal"])
    records = run_steps(config)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        # random rewards may give a group zero advantages (grad 0): only finiteness is data-independent here
        assert r["train/num_updates"] == 2.0 and math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"])


def test_engine_takes_per_expert_checkpoint_names_into_fused_experts():
    import torch

    from relax.backends.embedded.weight_names import expert_aliases

    gate_up = torch.zeros(3, 2 * 4, 5)
    down = torch.zeros(3, 5, 4)
    aliases = {**expert_aliases("model.layers.0.mlp.experts.gate_up_proj", gate_up),
               **expert_aliases("model.layers.0.mlp.experts.down_proj", down)}
    assert len(aliases) == 9 and expert_aliases("model.layers.0.mlp.gate.weight", torch.zeros(3, 5)) == {}
    g, u, d = torch.randn(4, 5), torch.randn(4, 5), torch.randn(5, 4)
    aliases["model.layers.0.mlp.experts.1.gate_proj.weight"].copy_(g)
    aliases["model.layers.0.mlp.experts.1.up_proj.weight"].copy_(u)
    aliases["model.layers.0.mlp.experts.1.down_proj.weight"].copy_(d)
    # transformers' experts forward: gate, up = linear(x, gate_up_proj[e]).chunk(2); out = linear(h, down_proj[e])
    assert torch.equal(gate_up[1], torch.cat([g, u])) and torch.equal(down[1], d)
    assert gate_up[0].abs().sum() == 0 and gate_up[2].abs().sum() == 0
