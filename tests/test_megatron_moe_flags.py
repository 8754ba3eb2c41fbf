"""MoE flags of launch scripts: --moe-router-dtype reaches Megatron's config and runs the router in that dtype;
--moe-token-dispatcher-type is alltoall (Relax's default and only dispatcher, said in the help)."""

import pytest
import torch

from relax.backends.megatron.testing import build_random_tiny_moe_model, ensure_single_process, hf_trainer, toy_samples
from relax.config import parse_config
from relax.config.support import unsupported_flags

torch.set_num_threads(1)


def test_router_dtype_reaches_megatron_and_keeps_the_logprobs(tmp_path):
    ensure_single_process()
    path = build_random_tiny_moe_model(tmp_path / "moe", seed=4)
    samples = toy_samples(2, seed=5)
    results = {}
    for dtype in (None, "fp64"):
        trainer = hf_trainer(path, lr=1e-3, micro_batch_size=2, moe_router_dtype=dtype)
        assert trainer.config.moe_router_dtype == dtype
        results[dtype] = trainer.compute_logprobs(samples)
    for a, b in zip(results[None], results["fp64"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_dispatcher_flag_is_alltoall_only(tmp_path):
    base = ["--output-dir", str(tmp_path)]
    assert parse_config(base).moe_token_dispatcher_type == "alltoall"
    assert unsupported_flags(parse_config(base + ["--moe-token-dispatcher-type", "alltoall",
                                                  "--moe-router-dtype", "fp32"])) == []
    assert unsupported_flags(parse_config(base + ["--moe-token-dispatcher-type", "allgather"])) == \
        ["--moe-token-dispatcher-type allgather"]


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_router_dtype_maps_to_the_trainer(tmp_path, dtype):
    from relax.roles.megatron_settings import trainer_settings

    config = parse_config(["--output-dir", str(tmp_path), "--moe-router-dtype", dtype])
    assert trainer_settings(config).moe_router_dtype == dtype
