"""Uneven pipeline stages (--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers, and
--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split) on PP=2 over gloo: each stage
builds the layers Megatron assigns it, and log-probs, training and the exported HF weights match one rank."""

import pytest
import torch

from relax.backends.megatron.testing import (
    build_random_tiny_model,
    ensure_single_process,
    hf_arch,
    run_ranks,
    toy_pg_loss,
    toy_samples,
)
from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings

torch.set_num_threads(1)

BASE = dict(lr=1e-3, micro_batch_size=2, seed=11, clip_grad=1.0)
# 4 layers: first stage 1 (so the last stage 3; --decoder-last-pipeline-num-layers is the same TransformerConfig
# path, tests/test_megatron_options.py); with the embedding and the loss counted as layers (6 = 3 + 3), the
# first stage holds 2 transformer layers and the last stage 2
LAYOUTS = {
    "first1": (("decoder_first_pipeline_num_layers", 1),),
    "account": (("account_for_embedding_in_pipeline_split", True), ("account_for_loss_in_pipeline_split", True)),
}
EXPECTED_LAYERS = {"first1": [[0], [1, 2, 3]], "account": [[0, 1], [2, 3]]}


def _worker(rank, world, path, samples):
    from megatron.core import parallel_state as ps

    out = {}
    for name, options in LAYOUTS.items():
        trainer = MegatronTrainer(hf_arch(path), TrainerSettings(**BASE, pp=2, megatron_options=options))
        trainer.load_hf(path)
        layers = [layer.layer_number - 1 for layer in trainer.gpt_model.decoder.layers]
        logprobs = trainer.compute_logprobs(samples)
        metrics = trainer.train_step(samples, toy_pg_loss)
        out[name] = {"layers": layers, "logprobs": logprobs, "loss": metrics["loss"],
                     "weights": dict(trainer.export_hf_weights())}
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_random_tiny_model(tmp_path_factory.mktemp("pp") / "qwen2", "qwen2", seed=21, num_hidden_layers=4)
    samples = toy_samples(4, seed=9)
    ranks = run_ranks(_worker, 2, str(path), samples, timeout=300)
    ensure_single_process()
    trainer = MegatronTrainer(hf_arch(path), TrainerSettings(**BASE))
    trainer.load_hf(path)
    reference = {"logprobs": trainer.compute_logprobs(samples)}
    reference["loss"] = trainer.train_step(samples, toy_pg_loss)["loss"]
    reference["weights"] = dict(trainer.export_hf_weights())
    return ranks, reference


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_uneven_stages_match_one_rank(setup, name):
    ranks, reference = setup
    assert [r[name]["layers"] for r in ranks] == EXPECTED_LAYERS[name]
    for got in ranks:
        for a, b in zip(got[name]["logprobs"], reference["logprobs"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert got[name]["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    # each stage exports the HF tensors of its own layers: together, the whole model after the same update
    weights = {key: value for got in ranks for key, value in got[name]["weights"].items()}
    assert set(weights) == set(reference["weights"])
    for key, value in weights.items():
        torch.testing.assert_close(value, reference["weights"][key], rtol=1e-5, atol=1e-6)
