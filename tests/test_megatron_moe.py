"""Qwen3-MoE: HF logits at TP=1, and expert parallelism (EP=2) against EP=1."""

import pytest
import torch

from relax.backends.megatron.transformer_config import to_transformer_config
from relax.formats.model_arch import ModelArch
from relax.backends.megatron.hf_weights import export_hf_weights, load_hf_checkpoint_dir, load_hf_weights
from relax.backends.megatron.model import build_gpt_model
from relax.backends.megatron.testing import (
    build_random_tiny_moe_model,
    ensure_single_process,
    hf_response_logprobs,
    run_ranks,
    toy_pg_loss,
    toy_samples,
)
from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings

torch.set_num_threads(1)

STEPS = 2
BASE = dict(lr=1e-3, micro_batch_size=2, seed=3)


def _arch(path):
    from transformers import AutoConfig

    return ModelArch.from_hf_config(AutoConfig.from_pretrained(path))


def _ep_worker(rank, world, path, samples):
    trainer = MegatronTrainer(_arch(path), TrainerSettings(ep=2, **BASE))
    trainer.load_hf(path)
    exported = dict(trainer.export_hf_weights())
    per = len(samples) // trainer.layout.dp
    mine = samples[trainer.layout.dp_rank * per : (trainer.layout.dp_rank + 1) * per]
    return {
        "export": exported,
        "logprobs": trainer.compute_logprobs(mine),
        "metrics": [trainer.train_step(mine, toy_pg_loss) for _ in range(STEPS)],
        "weights": dict(trainer.export_hf_weights()),
    }


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_random_tiny_moe_model(tmp_path_factory.mktemp("moe") / "qwen3moe", seed=4)


def test_moe_logits_match_hf_and_export_roundtrips(moe_dir):
    from transformers import AutoModelForCausalLM

    ensure_single_process()
    arch = _arch(moe_dir)
    assert arch.is_moe and arch.num_experts == 4 and arch.moe_router_topk == 2
    model = build_gpt_model(arch, to_transformer_config(arch)).eval()
    state = load_hf_checkpoint_dir(moe_dir)
    load_hf_weights(model, arch, state)
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(13).unsqueeze(0).expand(2, -1), None)
        assert (ours - hf(ids).logits).abs().max().item() < 1e-5
    exported = dict(export_hf_weights(model, arch))
    assert set(exported) == set(state.keys())
    assert all(torch.equal(exported[k], state[k]) for k in exported)


def test_expert_parallel_matches_single_rank(moe_dir):
    from transformers import AutoModelForCausalLM

    samples = toy_samples(4, seed=5)
    ranks = run_ranks(_ep_worker, 2, str(moe_dir), samples, timeout=300)

    ensure_single_process()
    trainer = MegatronTrainer(_arch(moe_dir), TrainerSettings(**BASE))
    trainer.load_hf(moe_dir)
    ref_metrics = [trainer.train_step(samples, toy_pg_loss) for _ in range(STEPS)]
    ref_weights = dict(trainer.export_hf_weights())
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    hf_lp = hf_response_logprobs(hf, samples)
    state = load_hf_checkpoint_dir(moe_dir)

    for rank, out in enumerate(ranks):
        # every EP rank exports all experts, bit-identical to the checkpoint
        assert set(out["export"]) == set(state.keys())
        assert all(torch.equal(out["export"][k], state[k]) for k in out["export"])
        mine = hf_lp[rank * 2 : rank * 2 + 2]
        assert max((a - b).abs().max().item() for a, b in zip(out["logprobs"], mine)) < 1e-5
        for got, want in zip(out["metrics"], ref_metrics):
            for key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        worst = max((out["weights"][k] - ref_weights[k]).abs().max().item() for k in ref_weights)
        assert worst < 0.1 * BASE["lr"], worst
