"""Rollout routing replay (--use-rollout-routing-replay, R3) on a tiny Qwen3-MoE:

* the embedded engine's `return_routed_experts` routes equal the experts an HF forward of the full sequence
  picks (float32, same weights), for prompt and response tokens, with several requests batched;
* routes survive the Sample codec (both layouts), the debug-rollout JSON files and partial-response merging;
* trainer: replaying the engine's routes gives the trainer's own log-probs when weights match; after a router
  change the forward and training passes use the engine's experts;
* a 2-step controller run with the flag, weights pushed every step.
"""

import json
import math

import numpy as np
import pytest
import torch

from relax.backends.embedded.routing import META_KEY, decode_routed_experts
from relax.backends.megatron.testing import (
    build_random_tiny_moe_model,
    ensure_single_process,
    toy_pg_loss,
)
from relax.data.routes import (
    decode_routes,
    encode_routes,
    merge_routes,
    routes_from_reply,
    routes_rows,
)
from relax.data.sample import Sample

torch.set_num_threads(1)
TOPK, LAYERS = 2, 2


def _with_tokenizer(path):
    from relax.models.tiny import build_byte_tokenizer

    tok = build_byte_tokenizer()
    tok.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return _with_tokenizer(build_random_tiny_moe_model(tmp_path_factory.mktemp("r3") / "qwen3moe", seed=7))


@pytest.fixture(scope="module")
def engine_replies(moe_dir):
    """Three prompts of different lengths generated together (one batched prefill + batched decode steps)."""
    from relax.backends.embedded.engine import EmbeddedEngine
    from relax.backends.embedded.sampling import SamplingParams

    eng = EmbeddedEngine(str(moe_dir), random_seed=0, max_running_requests=8)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    reqs = [eng.make_request(p, SamplingParams.from_dict({"temperature": 1.0, "max_new_tokens": 6 + i,
                                                          "ignore_eos": True, "sampling_seed": 10 + i}),
                             return_logprob=True, return_routed_experts=True) for i, p in enumerate(prompts)]
    plain = eng.make_request(prompts[0], SamplingParams.from_dict({"max_new_tokens": 2}))
    eng.start()
    try:
        futures = [eng.submit(r) for r in reqs + [plain]]  # queued before the scheduler admits: one prefill
        replies = [f.result(120) for f in futures]
    finally:
        eng.shutdown()
    assert META_KEY not in replies[-1]["meta_info"]  # only asked-for routes are sent
    return prompts, replies[:-1]


def _hf_routes(model, ids):
    """[T, L, k] sorted experts an HF forward of `ids` picks, from the routers' own top-k."""
    from relax.backends.embedded.routing import find_routers

    seen = []
    hooks = [m.register_forward_hook(lambda mod, a, out: seen.append(out[2].detach().clone()))
             for m, _ in find_routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, dim=1).sort(dim=-1).values  # [T, L, k]


def test_engine_routes_equal_hf_forward_of_full_sequence(moe_dir, engine_replies):
    from relax.backends.embedded.testing import load_reference_model

    prompts, replies = engine_replies
    ref = load_reference_model(str(moe_dir))
    for prompt, reply in zip(prompts, replies):
        out = reply["output_ids"]
        rows = len(prompt) + len(out) - 1  # the last sampled token is never run through the model
        got = torch.from_numpy(decode_routed_experts(reply["meta_info"][META_KEY], rows)).view(rows, LAYERS, TOPK)
        want = _hf_routes(ref, prompt + out[:-1])
        assert torch.equal(got.sort(dim=-1).values.long(), want.long())
        assert got.min() >= 0 and got.max() < 4 and len(out) >= 6


def test_routes_round_trip_codec_json_and_merge(tmp_path):
    from relax.data.codec import decode_samples, encode_records, encode_samples
    from relax.rollout.debug_data import load_rollout_data, save_rollout_data

    grid = np.arange(7 * LAYERS * TOPK, dtype=np.int32).reshape(7, LAYERS, TOPK) % 5
    data = encode_routes(grid)
    assert data["shape"] == [7, LAYERS * TOPK] and np.array_equal(decode_routes(data), grid.reshape(7, -1))
    samples = [Sample(index=0, prompt_tokens=[1, 2, 3], response_tokens=[4, 5, 6, 7, 8], rollout_routed_experts=data),
               Sample(index=1, prompt_tokens=[1], response_tokens=[2])]
    for td in (encode_samples(samples), encode_records(samples)):
        back = decode_samples(td)
        assert back[0].rollout_routed_experts == data and back[1].rollout_routed_experts is None
    save_rollout_data(str(tmp_path / "r_{rollout_id}.jsonl"), 3, samples)
    loaded = load_rollout_data(str(tmp_path / "r_{rollout_id}.jsonl"), 3)
    assert np.array_equal(decode_routes(loaded[0].rollout_routed_experts), grid.reshape(7, -1))
    # a resumed request re-sends the whole context: its routes cover the old rows too and win; older rows
    # beyond it are kept, in token order
    newer = encode_routes(grid[:4] + 1)
    merged = decode_routes(merge_routes(data, newer))
    assert np.array_equal(merged[:4], (grid[:4] + 1).reshape(4, -1)) and np.array_equal(merged[4:], grid[4:].reshape(3, -1))
    assert merge_routes(newer, data) == data and merge_routes(None, newer) == newer
    reply = encode_routes(grid)["b64"]
    assert routes_rows(routes_from_reply(reply, 7)) == 7
    with pytest.raises(ValueError):
        routes_from_reply(reply, 6)


@pytest.fixture(scope="module")
def trainer(moe_dir):
    from transformers import AutoConfig

    from relax.formats.model_arch import ModelArch
    from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings

    ensure_single_process()
    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(moe_dir))
    t = MegatronTrainer(arch, TrainerSettings(lr=0.0, micro_batch_size=2, seed=3, routing_replay=True))
    t.load_hf(moe_dir)
    return t


def _config(moe_dir, tmp_path):
    from relax.config import parse_config

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "1+1=", "label": "2"}\n')
    return parse_config(["--hf-checkpoint", str(moe_dir), "--prompt-data", str(prompts),
                         "--use-rollout-routing-replay", "--rollout-batch-size", "3", "--global-batch-size", "3",
                         "--num-rollout", "1", "--output-dir", str(tmp_path / "out")])


def _engine_samples(engine_replies):
    prompts, replies = engine_replies
    out = []
    for i, (p, r) in enumerate(zip(prompts, replies)):
        tokens = r["output_ids"]
        routes = routes_from_reply(r["meta_info"][META_KEY], len(p) + len(tokens) - 1)
        out.append(Sample(index=i, group_index=i, prompt_tokens=p, response_tokens=tokens,
                          response_logprobs=[x[0] for x in r["meta_info"]["output_token_logprobs"]],
                          reward=float(i % 2), rollout_routed_experts=routes))
    return out


def _routers(trainer):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in trainer.gpt_model.modules() if isinstance(m, TopKRouter)]


def test_trainer_replays_engine_routes(trainer, moe_dir, engine_replies, tmp_path):
    from relax.backends.megatron.routing_replay import ROUTES_KEY
    from relax.training.advantages import trainer_inputs
    from relax.training.step import rollout_replay_routes

    samples = _engine_samples(engine_replies)
    config = _config(moe_dir, tmp_path)
    assert config.use_rollout_routing_replay and config.use_routing_replay
    assert trainer.moe_stage_layers() == [0, 1]
    routes = rollout_replay_routes(trainer, samples, config)
    base = trainer_inputs(samples, [0.0] * len(samples))
    plain, own = trainer.compute_logprobs_and_routes(base)
    for s, r, o in zip(samples, routes, own):
        n = s.total_length
        assert tuple(r.shape) == (LAYERS, n - 1, TOPK)
        # Megatron's routers (same weights, float32) pick the engine's experts for every token it ran
        assert torch.equal(r.sort(dim=-1).values, o[:, : n - 1].sort(dim=-1).values)
    replayed = [{**x, ROUTES_KEY: r} for x, r in zip(base, routes)]
    with_replay = trainer.compute_logprobs(replayed)
    for a, b in zip(with_replay, plain):
        assert torch.allclose(a, b, atol=1e-5)

    routers = _routers(trainer)
    saved = [r.weight.detach().clone() for r in routers]
    gen = torch.Generator().manual_seed(11)
    seen = [[] for _ in routers]
    hooks = [r.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[1].detach().clone()))
             for i, r in enumerate(routers)]
    try:
        with torch.no_grad():
            for r in routers:
                r.weight.copy_(torch.randn(r.weight.shape, generator=gen) * 3.0)
        fresh = trainer.compute_logprobs(base)
        replayed_lp = trainer.compute_logprobs(replayed)
        assert max(float((a - b).abs().max()) for a, b in zip(fresh, replayed_lp)) > 1e-4
        for s in seen:
            s.clear()
        out = trainer.train_step([{**x, "advantages": torch.ones(x["response_length"]), "old_logprobs": lp}
                                  for x, lp in zip(replayed, replayed_lp)], toy_pg_loss)
        assert math.isfinite(out["loss"])
        # micro-batches of 2: samples (0, 1) then (2,); the routing maps hold exactly the engine's experts
        for layer in range(LAYERS):
            for m, group in enumerate(((0, 1), (2,))):
                rmap = seen[layer][m]
                seq = max(samples[i].total_length for i in group)
                experts = rmap.nonzero()[:, 1].view(seq, len(group), TOPK)
                for b, i in enumerate(group):
                    n = samples[i].total_length
                    want = routes[i][layer].sort(dim=-1).values
                    assert torch.equal(experts[: n - 1, b], want)
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for r, w in zip(routers, saved):
                r.weight.copy_(w)


def test_missing_routes_fail_naming_the_sample(trainer, moe_dir, engine_replies, tmp_path):
    from relax.training.step import rollout_replay_routes

    config = _config(moe_dir, tmp_path)
    samples = _engine_samples(engine_replies)
    samples[1].rollout_routed_experts = None
    with pytest.raises(RuntimeError, match="sample 1 .*no routed experts"):
        rollout_replay_routes(trainer, samples, config)
    samples = _engine_samples(engine_replies)
    short = decode_routes(samples[2].rollout_routed_experts)[:-2]
    samples[2].rollout_routed_experts = encode_routes(short)
    with pytest.raises(RuntimeError, match="sample 2"):
        rollout_replay_routes(trainer, samples, config)
    # the final response token has no route and is not needed; nor is a loss-masked tail (2 tokens short:
    # the last 2 response tokens must be out of the loss)
    samples[2].loss_mask = [1] * (len(samples[2].response_tokens) - 1) + [0]
    with pytest.raises(RuntimeError, match="sample 2"):
        rollout_replay_routes(trainer, samples, config)
    samples[2].loss_mask = [1] * (len(samples[2].response_tokens) - 2) + [0, 0]
    assert rollout_replay_routes(trainer, samples, config)[2].shape[1] == samples[2].total_length - 3
    # a sample with nothing trained needs no routes
    samples[0].rollout_routed_experts, samples[0].loss_mask = None, [0] * len(samples[0].response_tokens)
    assert rollout_replay_routes(trainer, samples, config)[0].shape == (LAYERS, 0, TOPK)


def test_support_set(moe_dir, tmp_path):
    from relax.config.support import unsupported_flags

    assert unsupported_flags(_config(moe_dir, tmp_path)) == []


@pytest.mark.e2e
def test_rollout_routing_replay_end_to_end(tmp_path):
    """Controller, real Ray, Megatron over gloo, embedded engine behind the sglang router, TransferQueue: 2
    steps with --use-rollout-routing-replay. The rollout asks for routes through the router; the trainer
    refuses samples without them, so finite training metrics prove they arrived. The saved rollouts hold
    routes for every token the engine ran."""
    from relax.config import parse_config
    from conftest import run_steps
    from relax.models.tasks import generate_task_dataset

    model = _with_tokenizer(build_random_tiny_moe_model(tmp_path / "moe", seed=2))
    data = generate_task_dataset(tmp_path / "train.jsonl", 16, seed=0, task="add_mod10")
    out = tmp_path / "run"
    config = parse_config(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--apply-chat-template",
                           "--input-key", "input", "--label-key", "label", "--rm-type", "random",
                           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "2",
                           "--rollout-max-response-len", "4", "--micro-batch-size", "1", "--lr", "1e-2",
                           "--num-rollout", "2", "--resource", '{"actor": [1, 1], "rollout": [1, 1]}',
                           "--num-data-storage-units", "1", "--output-dir", str(out), "--distributed-backend", "gloo",
                           "--use-rollout-routing-replay", "--check-weight-update-equal",
                           "--save-debug-rollout-data", str(tmp_path / "dbg" / "{rollout_id}.jsonl")])
    records = run_steps(config)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["train/num_updates"] == 2.0 and math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"])
    from relax.rollout.debug_data import load_rollout_data

    for step in (0, 1):
        for s in load_rollout_data(str(tmp_path / "dbg" / "{rollout_id}.jsonl"), step):
            assert s.rollout_routed_experts["shape"] == [s.total_length - 1, LAYERS * TOPK]


def test_rollout_routes_to_stage_slices_layers_and_tokens():
    from relax.backends.megatron.routing_replay import rollout_routes_to_stage

    grid = torch.arange(5 * 3 * TOPK).view(5, 3, TOPK)  # [tokens, HF layers, k]
    flat = grid.reshape(5, -1).numpy()
    full = rollout_routes_to_stage(flat, [0, 1, 2], TOPK, 6)
    assert torch.equal(full, grid.permute(1, 0, 2))
    second_stage = rollout_routes_to_stage(flat, [2], TOPK, 4)  # a pipeline stage owning layer 2 only
    assert torch.equal(second_stage, grid[:4, 2:3].permute(1, 0, 2))
    with pytest.raises(ValueError):
        rollout_routes_to_stage(flat, [3], TOPK, 6)
    with pytest.raises(ValueError):
        rollout_routes_to_stage(flat[:, :5], [0], TOPK, 6)
