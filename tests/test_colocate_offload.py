"""The trainer offloader on one CPU rank: offload frees the parameter, grad-buffer and optimizer storages (resident
memory drops), reload restores them byte for byte, and training after offload+reload is bit-identical to
training without it."""

import pytest
import torch

from conftest import shared_tiny_model

from relax.formats.model_arch import ModelArch
from relax.backends.megatron.offload import TrainerOffloader, rss_bytes
from relax.backends.megatron.testing import toy_pg_loss, toy_samples
from relax.backends.megatron.trainer import MegatronTrainer, TrainerSettings

torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("megatron_process")  # tests/megatron_fixtures.py
# the model of `model_dir` (tests/conftest.py): big enough (tens of MB of params + Adam state) that freeing it shows
# in the resident set size
RANDOM_MODEL = dict(seed=2, hidden_size=384, intermediate_size=1536, num_hidden_layers=4)


def _trainer(path):
    from transformers import AutoConfig

    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(path))
    trainer = MegatronTrainer(arch, TrainerSettings(lr=1e-3, micro_batch_size=2, seed=7))
    trainer.load_hf(path)
    return trainer


def _snapshot(trainer):
    out = {f"p/{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    for n, p in trainer.model.named_parameters():
        out[f"g/{n}"] = p.main_grad.detach().clone()
    for i, state in enumerate(trainer.optimizer.optimizer.state.values() if hasattr(trainer.optimizer, "optimizer")
                              else []):
        for k, v in state.items():
            out[f"o/{i}/{k}"] = v.detach().clone()
    return out


def test_offload_frees_memory_and_reload_is_exact(model_dir, tmp_path):
    samples = toy_samples(4, seed=1)
    a, b = _trainer(model_dir), _trainer(model_dir)
    for t in (a, b):
        t.train_step(samples, toy_pg_loss)  # Adam state exists now
    before = _snapshot(a)
    assert any(k.startswith("o/") for k in before)
    off = TrainerOffloader(a, tmp_path / "spill" / "rank-0.bin")
    report = off.offload()
    assert off.offloaded and (tmp_path / "spill" / "rank-0.bin").stat().st_size == report["offload/bytes"]
    params = sum(p.numel() * p.element_size() for p in a.model.parameters())
    assert report["offload/bytes"] >= 3 * params  # params + grads + two Adam moments
    assert report["offload/kept_bytes"] == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in a.model.parameters())
    freed = report["offload/rss_before"] - report["offload/rss_after"]
    print(f"\nRSS before offload {report['offload/rss_before'] / 2**20:.1f} MiB, after "
          f"{report['offload/rss_after'] / 2**20:.1f} MiB (freed {freed / 2**20:.1f} MiB of "
          f"{report['offload/bytes'] / 2**20:.1f} MiB offloaded, {report['offload/kept_bytes'] / 2**20:.1f} MiB kept)")
    assert freed > 0.5 * report["offload/bytes"], report
    assert off.offload() == {"offload/bytes": 0.0}  # idempotent
    back = off.reload()
    assert back["reload/bytes"] == report["offload/bytes"] and not off.offloaded
    assert not (tmp_path / "spill" / "rank-0.bin").exists()
    after = _snapshot(a)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    # training continues exactly as in a trainer that was never offloaded
    more = toy_samples(4, seed=2)
    ma, mb = a.train_step(more, toy_pg_loss), b.train_step(more, toy_pg_loss)
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    for (na, pa), (nb, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), na
    assert rss_bytes() > 0


def test_engine_resumes_tag_by_tag_and_logs_events(tmp_path):
    """SGLang's order: release all, resume weights (generation still refused, weight update accepted), then the
    KV cache (generation again); the engine's event log records it."""
    from relax.backends.embedded.engine import EmbeddedEngine
    from relax.backends.embedded.sampling import SamplingParams

    model = str(shared_tiny_model())
    eng = EmbeddedEngine(model, random_seed=0, offload_weights_on_release=True).start()

    def gen():
        req = eng.make_request([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=6))
        return eng.submit(req).result(60)["output_ids"]

    try:
        before = gen()
        saved = [(n, p.detach().clone()) for n, p in eng.model.named_parameters()]
        eng.release_memory(["weights", "kv_cache"]).result(10)
        assert eng.released and all(p.numel() == 0 for p in eng.model.parameters())
        eng.resume_memory(["weights"]).result(10)
        assert eng.released  # the KV cache is still released: no generation yet
        eng.update_weights(saved, "7").result(10)
        eng.resume_memory(["kv_cache"]).result(10)
        assert not eng.released and gen() == before
        kinds = [(e["event"], e["tags"], e["memory_released"]) for e in eng.memory_events]
        assert kinds == [("release", ["kv_cache", "weights"], ["kv_cache", "weights"]),
                         ("resume", ["weights"], ["kv_cache"]), ("update_weights", [], ["kv_cache"]),
                         ("resume", ["kv_cache"], [])]
        assert eng.memory_events[2]["weight_version"] == "7"
    finally:
        eng.shutdown()
