"""Weight updates into the embedded engine through EngineClient: shared-memory tensors (flattened
buckets and plain lists, chunked), disk, and a gloo broadcast group; plus serialization units."""

import base64
import io
import os
import pickle

import pytest
import torch

from relax.backends.embedded.testing import (
    load_reference_model,
    max_abs_diff,
    perturbed_state_dict,
    reference_greedy,
    reference_logprobs,
    response_logprobs,
)
from relax.wire.engine_client import EngineClient, EngineRequestError
from relax.wire.net import find_free_port
from relax.models.tiny import TinyArch, build_tiny_model_dir
from relax.weights.distributed import WeightUpdateGroup
from relax.wire.serialize import (
    deserialize_named_tensors,
    iter_buckets,
    restricted_loads,
    serialize_named_tensors,
)

T = 60
PROMPT = [12, 34, 56, 78, 90, 11]


@pytest.fixture(scope="module")
def client(server):
    c = EngineClient(server.url, timeout_s=T)
    yield c
    c.close()


def model_with(model_dir, named):
    m = load_reference_model(model_dir)
    sd = dict(named)
    missing = [n for n, _ in m.named_parameters() if n not in sd]
    assert not missing
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(sd[n])
    return m


def assert_serves(client, ref, version, temperature=0.7):
    r = client.generate(PROMPT, {"temperature": temperature, "max_new_tokens": 16, "ignore_eos": True},
                        return_logprob=True)
    assert r["meta_info"]["weight_version"] == version
    assert max_abs_diff(response_logprobs(r), reference_logprobs(ref, PROMPT, r["output_ids"], temperature)) <= 1e-5
    g = client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    assert g["output_ids"] == reference_greedy(ref, PROMPT, 12)
    return g["output_ids"]


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_update_from_tensor(client, model_dir, load_format):
    base = load_reference_model(model_dir)
    seed = 1 if load_format else 2
    new = perturbed_state_dict(base, seed=seed)
    new_ref = model_with(model_dir, new)
    before = client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})["output_ids"]
    version = f"tensor-{seed}"
    stats = client.update_weights_from_tensor(new, weight_version=version, buffer_bytes=64 << 10,
                                              load_format=load_format)
    assert stats["num_requests"] > 1 and stats["num_tensors"] == len(new)
    assert client.get_weight_version() == version
    after = assert_serves(client, new_ref, version)
    assert after != before
    # Sent tensors are not rehomed: the caller's tensors stay ordinary (non-shared) memory.
    assert not any(t.is_shared() for _, t in new)


def test_update_from_disk(client, model_dir, tmp_path):
    new_dir = str(build_tiny_model_dir(tmp_path / "new", TinyArch(family="qwen2"), seed=5))
    new_ref = load_reference_model(new_dir)
    res = client.update_weights_from_disk(new_dir, weight_version="disk-5")
    assert res["success"] is True
    assert client.get_weight_version() == "disk-5"
    assert_serves(client, new_ref, "disk-5", temperature=1.0)
    assert client.model_info()["model_path"] == new_dir
    with pytest.raises(EngineRequestError, match="update_weights_from_disk"):
        client.update_weights_from_disk(str(tmp_path / "missing"), weight_version="nope")
    assert client.get_weight_version() == "disk-5"


def test_update_from_distributed_gloo(client, model_dir):
    base = load_reference_model(model_dir)
    new = perturbed_state_dict(base, seed=9)
    new_ref = model_with(model_dir, new)
    group = WeightUpdateGroup([client], master_address="127.0.0.1", master_port=find_free_port(),
                              group_name="test_group", backend="gloo", timeout_s=60)
    group.init()
    try:
        assert group.world_size == 2
        group.update(new, weight_version="dist-9")
        assert client.get_weight_version() == "dist-9"
        assert_serves(client, new_ref, "dist-9")
        newer = perturbed_state_dict(base, seed=10)
        group.update(newer, weight_version="dist-10")  # the group is reusable
        assert_serves(client, model_with(model_dir, newer), "dist-10")
    finally:
        group.destroy()


def test_rejected_update_changes_nothing(client):
    v = client.get_weight_version()
    before = client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})["output_ids"]
    with pytest.raises(EngineRequestError, match="unknown parameter"):
        client.update_weights_from_tensor([("model.norm.weight", torch.zeros(64)), ("no.such.weight", torch.zeros(2))],
                                          weight_version="bad")
    assert client.get_weight_version() == v
    assert client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})["output_ids"] == before


def test_set_weight_version_and_get_weights_by_name(client):
    client.set_weight_version("manual-1")
    assert client.get_weight_version() == "manual-1"
    vals = client.get_weights_by_name("model.norm.weight", truncate_size=5)
    assert len(vals) == 5 and all(isinstance(v, float) for v in vals)


# ------------------------------------------------------------------------------ serialization units
def test_iter_buckets_respects_buffer_and_dtype():
    ts = [(f"t{i}", torch.zeros(10, dtype=torch.float32 if i % 3 else torch.bfloat16)) for i in range(9)]
    buckets = list(iter_buckets(ts, 100))
    assert sum(len(b) for b in buckets) == 9
    assert all(sum(t.numel() * t.element_size() for _, t in b) <= 100 or len(b) == 1 for b in buckets)
    by_dtype = list(iter_buckets(ts, 1 << 20, group_by_dtype=True))
    assert len(by_dtype) == 2 and all(len({t.dtype for _, t in b}) == 1 for b in by_dtype)
    big = list(iter_buckets([("big", torch.zeros(1000))], 10))
    assert len(big) == 1
    with pytest.raises(ValueError):
        list(iter_buckets(ts, 0))


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_serialize_roundtrip(load_format):
    ts = [("a", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.float32)), ("c", torch.randn(2, 2, 2))]
    data, keep = serialize_named_tensors(ts, load_format)
    assert isinstance(data, str) and len(data) < 4000  # names of shared-memory files, not the data
    back = deserialize_named_tensors(data, load_format)
    assert [n for n, _ in back] == ["a", "b", "c"]
    for (_, x), (_, y) in zip(ts, back):
        assert torch.equal(x, y)


def test_sglang_style_flattened_metadata_is_accepted():
    from multiprocessing.reduction import ForkingPickler

    flat = torch.arange(6, dtype=torch.float32)
    meta = [{"name": "w", "shape": (2, 3), "dtype": torch.float32, "start_idx": 0, "end_idx": 6, "numel": 6}]
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": meta})
    back = deserialize_named_tensors(base64.b64encode(buf.getvalue()).decode(), "flattened_bucket")
    assert back[0][0] == "w" and torch.equal(back[0][1], flat.reshape(2, 3))


def test_restricted_unpickler_refuses_code():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(pickle.UnpicklingError):
        restricted_loads(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError):
        restricted_loads(pickle.dumps(eval))
