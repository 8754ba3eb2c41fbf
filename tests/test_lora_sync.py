"""Adapter-only sync to a real embedded engine server (relax/backends/megatron/lora_sync.py ->
relax/backends/embedded/lora.py, SGLang's /load_lora_adapter and /unload_lora_adapter): after each push the engine's
log-probs of requests naming the adapter (SGLang's `lora_path`) equal the LoRA trainer's within 1e-5, requests
naming none get the base in the same batch, the engine's checksum of what it loaded is verified, and the bytes of a
push are proportional to the rank."""

import pytest
import torch

from relax.backends.megatron.lora import LoraSettings
from relax.backends.megatron.lora_sync import push_adapter
from relax.backends.megatron.testing import hf_trainer, toy_pg_loss, toy_samples

pytestmark = pytest.mark.usefixtures("megatron_process")

RANDOM_MODEL = dict(seed=9)  # the module's model_dir (tests/conftest.py), served by `server` (tests/engine_fixtures.py)
PROMPTS = [[12, 34, 56, 78, 90, 11], [5, 6, 7, 8]]
TEMPERATURE = 0.8
SETTINGS = dict(lr=2e-2, micro_batch_size=2, seed=3)


def _client(url):
    from relax.wire.engine_client import EngineClient

    return EngineClient(url, timeout_s=60)


def _generate(url, lora):
    """One batched /generate of PROMPTS, `lora` its lora_path (a name, or one per prompt)."""
    from relax.backends.embedded.testing import response_logprobs

    client = _client(url)
    try:
        out = client.generate(PROMPTS, {"temperature": TEMPERATURE, "max_new_tokens": 6, "ignore_eos": True},
                              return_logprob=True, lora_path=lora)
    finally:
        client.close()
    return [(p + r["output_ids"], len(r["output_ids"]), response_logprobs(r)) for p, r in zip(PROMPTS, out)]


def _diff(trainer, rows):
    want = trainer.compute_logprobs([{"tokens": torch.tensor(t), "response_length": n} for t, n, _ in rows],
                                    TEMPERATURE)
    return max(max(abs(a - b) for a, b in zip(got, w.tolist())) for (_, _, got), w in zip(rows, want))


def test_adapter_push_serves_the_trainers_policy_and_the_base_beside_it(server, model_dir, tmp_path):
    trainer = hf_trainer(model_dir, **SETTINGS, lora=LoraSettings(rank=8, alpha=16.0, seed=3))
    base = hf_trainer(model_dir, **SETTINGS)
    samples = toy_samples(4, seed=4, vocab=300)
    for version in (1, 2):
        trainer.train_step(samples, toy_pg_loss)
        report = push_adapter(trainer, [server.url], tmp_path, version)
        assert report["bytes"] > 0 and report["checksum"] > 0
        client = _client(server.url)
        assert client.get_weight_version() == str(version)
        client.close()
        assert _diff(trainer, _generate(server.url, "policy")) <= 1e-5
        assert _diff(base, _generate(server.url, "policy")) > 1e-3  # the adapter is what moved
        assert _diff(base, _generate(server.url, None)) <= 1e-5  # requests naming no adapter: the base
        mixed = _generate(server.url, ["policy", None])  # one batch, one row each
        assert _diff(trainer, mixed[:1]) <= 1e-5 and _diff(base, mixed[1:]) <= 1e-5


def test_refusals(server, model_dir, tmp_path):
    from relax.wire.engine_client import EngineRequestError

    trainer = hf_trainer(model_dir, **SETTINGS, lora=LoraSettings(rank=2, alpha=2.0, seed=3))
    push_adapter(trainer, [server.url], tmp_path, 7)
    with pytest.raises(EngineRequestError, match="no such adapter is loaded"):
        _generate(server.url, "other")
    client = _client(server.url)
    try:  # one adapter at a time
        res = client._post("/load_lora_adapter", {"lora_name": "second", "lora_path": str(tmp_path / "v7")})
        assert not res["success"] and "one adapter at a time" in res["error_message"]
        assert res["loaded_adapters"] == {"policy": str(tmp_path / "v7")}
        res = client._post("/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
        assert not res["success"]
        assert client._post("/unload_lora_adapter", {"lora_name": "policy"})["loaded_adapters"] == {}
    finally:
        client.close()


def test_push_bytes_are_proportional_to_the_rank(server, model_dir, tmp_path):
    sizes = {}
    for rank in (4, 8, 16):
        trainer = hf_trainer(model_dir, **SETTINGS, lora=LoraSettings(rank=rank, alpha=16.0, seed=3))
        sizes[rank] = push_adapter(trainer, [server.url], tmp_path / str(rank), 1)["bytes"]
    full = sum(t.numel() * t.element_size() for _, t in trainer.export_hf_weights())
    assert 1.9 < sizes[8] / sizes[4] < 2.1 and 1.9 < sizes[16] / sizes[8] < 2.1, sizes
    assert sizes[4] < full / 4, (sizes, full)
