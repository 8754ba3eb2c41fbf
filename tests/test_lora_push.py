"""A LoRA trainer's push (merged weights, --lora-merge-sync) into a real embedded engine server: after each push the
engine's log-probs of a fixed batch equal the trainer's within 1e-5 (fp32), and differ from the base's (the push
moved the adapters' change). relax/backends/megatron/lora.py, relax/weights/sync.py."""

import pytest
import torch

from relax.backends.megatron.lora import LoraSettings
from relax.backends.megatron.testing import hf_trainer, toy_pg_loss, toy_samples

pytestmark = pytest.mark.usefixtures("megatron_process")

RANDOM_MODEL = dict(seed=7)  # the module's model_dir (tests/conftest.py), served by `server` (tests/engine_fixtures.py)
PROMPTS = [[12, 34, 56, 78, 90, 11], [5, 6, 7, 8]]
TEMPERATURE = 0.8


def _engine_rows(url):
    """(prompt + reply tokens, reply length, the engine's log-probs of the reply) for each of PROMPTS."""
    from relax.backends.embedded.testing import response_logprobs
    from relax.wire.engine_client import EngineClient

    client = EngineClient(url, timeout_s=60)
    try:
        out = []
        for prompt in PROMPTS:
            r = client.generate(prompt, {"temperature": TEMPERATURE, "max_new_tokens": 6, "ignore_eos": True},
                                return_logprob=True)
            out.append((prompt + r["output_ids"], len(r["output_ids"]), response_logprobs(r),
                        r["meta_info"]["weight_version"]))
        return out
    finally:
        client.close()


def _trainer_rows(trainer, rows):
    samples = [{"tokens": torch.tensor(tokens), "response_length": n} for tokens, n, _, _ in rows]
    return trainer.compute_logprobs(samples, TEMPERATURE)


def test_engine_serves_the_trainers_lora_policy_after_each_push(server, model_dir):
    from relax.weights.sync import push_for_config

    trainer = hf_trainer(model_dir, lr=2e-2, micro_batch_size=2, seed=3, lora=LoraSettings(rank=8, alpha=16.0, seed=3))
    samples = toy_samples(4, seed=4, vocab=300)
    for version in (1, 2):
        trainer.train_step(samples, toy_pg_loss)
        # --check-weight-update-equal: the engine's copy of every pushed tensor is checked after the push
        push_for_config(list(trainer.export_hf_weights()), [server.url], version, {"check_weight_update_equal": True})
        rows = _engine_rows(server.url)
        assert all(v == str(version) for *_, v in rows)
        want = _trainer_rows(trainer, rows)
        for (_, _, got, _), expected in zip(rows, want):
            assert max(abs(a - b) for a, b in zip(got, expected.tolist())) <= 1e-5
    # the base's log-probs of the same tokens are not the pushed policy's: the adapters' change was pushed
    base = _trainer_rows(hf_trainer(model_dir, lr=2e-2, micro_batch_size=2, seed=3), rows)
    assert max((b - w).abs().max().item() for b, w in zip(base, want)) > 1e-3
