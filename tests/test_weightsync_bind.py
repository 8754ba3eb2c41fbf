"""The one-copy weight sync (`load_format="relax_shm_bind"`, `relax.weights.shm.BoundSegment`,
`relax.backends.embedded.shared_weights`): the trainer writes every tensor once into the half of a
double-buffered /dev/shm segment that the engines do not use, and their parameters become views of it.

Checked: every tensor arrives exactly (also through --check-weight-update-equal), parameters really are
views of the segment, halves alternate so that writing the next update never touches what generation in
flight reads, a rejected or failed update changes nothing and retires the segment, other update paths never
write into the shared pages, versions, the fallbacks (dtype, /dev/shm room), and the segment file is gone
after close (and after the sender is killed)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch

from engine_fixtures import reference_with

from relax.backends.embedded import shared_weights
from relax.backends.embedded.weight_names import expert_aliases
from relax.backends.embedded.engine import EmbeddedEngine, EngineError
from relax.backends.embedded.sampling import SamplingParams
from relax.backends.embedded.testing import (
    load_reference_model,
    max_abs_diff,
    perturbed_state_dict,
    reference_logprobs,
    response_logprobs,
)
from relax.wire.engine_client import EngineClient, EngineRequestError
from relax.backends.megatron.testing import build_random_tiny_moe_model
from relax.models.tiny import build_byte_tokenizer
from relax.weights import shm
from relax.weights.sync import WeightSyncError, close_all, make_weight_sync, push_for_config

torch.set_num_threads(1)
PROMPT = [12, 34, 56, 78, 90, 11]


def _tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("a", torch.randn(37, 11, generator=g).to(torch.bfloat16)),
        ("b", torch.randn(1000, generator=g)),
        ("empty", torch.zeros(0, 4)),
        ("c", torch.randint(-5, 5, (3, 7), generator=g, dtype=torch.int64)),
        ("d", torch.randn(5, 9, generator=g).t()),  # not contiguous
        ("e", torch.randn(2, 3, generator=g, dtype=torch.float64).to(torch.float16)),
    ]


def _read(buf: torch.Tensor, entry) -> torch.Tensor:
    name, dname, shape, start, numel, offset = entry
    dt = getattr(torch, dname)
    return buf[offset:offset + numel * dt.itemsize].view(dt).view(shape)


# ------------------------------------------------------------------------------- sender side alone
def test_bound_segment_writes_every_tensor_once_and_alternates_halves(tmp_path):
    bs = shm.BoundSegment(str(tmp_path))
    first = _tensors(0)
    entries = bs.write(first)
    path, half = bs.segment.path, bs.half_bytes
    assert os.path.basename(path).startswith(shm.PREFIX) and bs.segment.nbytes == 2 * half
    for (name, t), e in zip(first, entries):
        assert e[0] == name and e[3] == 0 and e[4] == t.numel() and e[5] % shm.ALIGN == 0 and e[5] < half
        assert torch.equal(_read(bs.segment.buf, e), t)
    bs.commit()  # the engines now read half 0: the next update goes to half 1 and leaves half 0 alone
    second = _tensors(1)
    entries2 = bs.write(second)
    assert bs.segment.path == path and all(half <= e[5] < 2 * half for e in entries2)
    for (_, t), e, e2 in zip(first, entries, entries2):
        assert torch.equal(_read(bs.segment.buf, e), t)  # half 0 untouched
    for (_, t), e2 in zip(second, entries2):
        assert torch.equal(_read(bs.segment.buf, e2), t)
    bs.commit()
    assert all(e[5] < half for e in bs.write(first))  # back to half 0
    bs.discard()  # a failed push: neither half is written again, the file is removed
    assert bs.segment is None and not os.path.exists(path)
    bs.write(first)
    assert bs.segment.path != path
    path = bs.segment.path
    bs.close()
    assert not os.path.exists(path)


def test_bound_segment_casts_to_the_engine_dtype_and_grows():
    bs = shm.BoundSegment()
    try:
        named = [("w", torch.randn(4, 5)), ("i", torch.arange(6))]
        cast = lambda n, t: torch.bfloat16 if t.is_floating_point() else t.dtype  # noqa: E731
        entries = bs.write(named, cast)
        assert [e[1] for e in entries] == ["bfloat16", "int64"]
        assert torch.equal(_read(bs.segment.buf, entries[0]), named[0][1].to(torch.bfloat16))
        assert bs.needed_bytes(bs.half_bytes) == 0 and bs.needed_bytes(bs.half_bytes + 1) > 0
        small = bs.segment.path
        bs.write([("w", torch.randn(1000, 100))])  # bigger than a half: a new, bigger segment
        assert bs.segment.path != small and not os.path.exists(small)
    finally:
        bs.close()


def test_segment_of_a_killed_sender_is_swept(tmp_path):
    code = ("import os, sys, torch; from relax.weights import shm; b = shm.BoundSegment(sys.argv[1]); "
            "b.write([('w', torch.ones(8))]); print(b.segment.path, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    dead = out.stdout.strip()
    assert os.path.exists(dead)
    assert shm.sweep_stale_segments(str(tmp_path)) == [dead] and not os.path.exists(dead)


# ------------------------------------------------------------------------------- engine in this process
@pytest.fixture()
def engine(model_dir):
    eng = EmbeddedEngine(model_dir, random_seed=0).start()
    try:
        yield eng
    finally:
        eng.shutdown()


def _bind(engine, bs, cache, named, version, cast=None):
    """What the server does for one relax_shm_bind request (the sender's part included)."""
    entries = bs.write(named, cast) if cast else bs.write(named)
    obj = shm.parse_manifest(shm.manifest(bs.segment, entries))
    pieces = list(shm.manifest_views(obj, cache))
    res = engine.bind_weights(pieces, cache.get(obj["segment"], obj["segment_bytes"]), version).result(60)
    bs.commit()
    return res


def _in_segment(p: torch.Tensor, bs, cache, half: int) -> bool:
    """Whether `p` lies in `half` of the engine's own mapping of the sender's segment."""
    lo = cache.get(bs.segment.path, bs.segment.nbytes).data_ptr() + half * bs.half_bytes
    return lo <= p.data_ptr() < lo + bs.half_bytes


def test_parameters_become_views_of_the_half_just_written(engine):
    bs, cache = shm.BoundSegment(), shm.SegmentCache()
    try:
        for i in range(3):
            named = perturbed_state_dict(engine.model, seed=10 + i)
            res = _bind(engine, bs, cache, named, f"v{i}")
            assert res["bound"] == len(named) and res["copied"] == 0 and engine.weight_version == f"v{i}"
            params = dict(engine.model.named_parameters())
            for n, t in named:
                assert torch.equal(params[n], t), n
                assert _in_segment(params[n], bs, cache, i % 2), n  # half 0, 1, 0, ...
            assert sorted(shared_weights.bound_parameters(engine)) == sorted(params)
        assert engine.stats["num_weight_updates"] == 3
    finally:
        bs.close()


def test_writing_the_next_update_during_generation_leaves_it_alone(engine, model_dir):
    """The trainer writes update k+1 while requests decode on update k: their tokens follow update k."""
    bs, cache = shm.BoundSegment(), shm.SegmentCache()
    ref = load_reference_model(model_dir)
    try:
        w1 = perturbed_state_dict(engine.model, seed=21)
        _bind(engine, bs, cache, w1, "w1")
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(dict(w1)[n])
        w2 = perturbed_state_dict(engine.model, seed=22)
        reqs = [engine.make_request(PROMPT, SamplingParams.from_dict(
            {"max_new_tokens": 48, "temperature": 0.8, "ignore_eos": True, "sampling_seed": s}),
            return_logprob=True) for s in range(3)]
        futures = [engine.submit(r) for r in reqs]
        writes = 0
        while not all(f.done() for f in futures):  # rewrite the other half as fast as possible meanwhile
            bs.write(w2)
            writes += 1
        assert writes > 1
        for f in futures:
            r = f.result(60)
            assert r["meta_info"]["weight_version"] == "w1"
            assert max_abs_diff(response_logprobs(r), reference_logprobs(ref, PROMPT, r["output_ids"], 0.8)) <= 1e-4
    finally:
        bs.close()


def test_rejected_bind_changes_nothing(engine):
    bs, cache = shm.BoundSegment(), shm.SegmentCache()
    try:
        good = perturbed_state_dict(engine.model, seed=30)
        _bind(engine, bs, cache, good, "good")
        before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        changed = perturbed_state_dict(engine.model, seed=31)
        for bad, why in (([("nope.weight", torch.ones(2))] + changed, "unknown parameter names"),
                         ([(changed[0][0], torch.ones(3, 3))] + changed[1:], "shape mismatch")):
            with pytest.raises(EngineError, match=why):
                _bind(engine, bs, cache, bad, "bad")
        for n, p in engine.model.named_parameters():
            assert torch.equal(p, before[n]), n
        assert engine.weight_version == "good"
    finally:
        bs.close()


def test_other_update_paths_never_write_into_the_segment(engine):
    bs, cache = shm.BoundSegment(), shm.SegmentCache()
    try:
        shared = perturbed_state_dict(engine.model, seed=40)
        _bind(engine, bs, cache, shared, "shared")
        half0 = bs.segment.buf[:bs.half_bytes].clone()
        engine.update_weights(perturbed_state_dict(engine.model, seed=41), "pickled").result(60)  # copies
        assert torch.equal(bs.segment.buf[:bs.half_bytes], half0)  # what other engines may still read
        assert shared_weights.bound_parameters(engine) == [] and engine.weight_version == "pickled"
        # a relax_shm (two-copy) update likewise
        _bind(engine, bs, cache, shared, "shared-again")
        half1 = bs.segment.buf[bs.half_bytes:].clone()
        pieces = [(n, tuple(t.shape), 0, t.reshape(-1).clone()) for n, t in perturbed_state_dict(engine.model, 42)]
        engine.update_weight_ranges(pieces, "ranges").result(60)
        assert torch.equal(bs.segment.buf[bs.half_bytes:], half1) and engine.weight_version == "ranges"
    finally:
        bs.close()


def test_a_dtype_the_engine_does_not_hold_is_copied_not_bound(engine):
    bs, cache = shm.BoundSegment(), shm.SegmentCache()
    try:
        named = [(n, t.to(torch.bfloat16)) for n, t in perturbed_state_dict(engine.model, seed=50)]
        res = _bind(engine, bs, cache, named, "bf16")
        assert res["bound"] == 0 and res["copied"] == len(named)
        params = dict(engine.model.named_parameters())
        for n, t in named:
            assert params[n].dtype == torch.float32 and torch.equal(params[n], t.float())
        # the sender casting to the engine's dtype (what TensorSync does with /server_info's dtype) binds
        res = _bind(engine, bs, cache, named, "cast", cast=lambda _n, _t: torch.float32)
        assert res["bound"] == len(named)
    finally:
        bs.close()


def test_fused_experts_are_copied_and_the_rest_stays_bound(tmp_path, monkeypatch):
    """A MoE engine takes per-expert names into transformers' fused expert tensors by copy (private memory),
    every other parameter is bound, push after push, without moving bound parameters out of the segment."""
    moe = build_random_tiny_moe_model(tmp_path / "moe", seed=3)
    build_byte_tokenizer().save_pretrained(moe)
    eng = EmbeddedEngine(str(moe), random_seed=0).start()
    bs, cache = shm.BoundSegment(), shm.SegmentCache()
    try:
        g = torch.Generator().manual_seed(0)
        fused, shapes = set(), []
        for name, p in eng.model.named_parameters():
            aliases = expert_aliases(name, p)
            fused |= {name} if aliases else set()
            shapes += [(n, a.shape) for n, a in aliases.items()] or [(name, p.shape)]
        assert fused
        for i in range(2):
            named = [(n, torch.randn(shape, generator=g)) for n, shape in shapes]
            if i:  # the copies go to private memory: nothing bound has to move out of the segment first
                monkeypatch.setattr(shared_weights, "privatize", lambda _e: pytest.fail("privatized"))
            res = _bind(eng, bs, cache, named, f"moe-{i}")
            assert res["copied"] == len(named) - res["bound"] and res["bound"] == len(shapes) - res["copied"] > 0
            assert sorted(shared_weights.bound_parameters(eng)) == sorted(
                n for n, _ in eng.model.named_parameters() if n not in fused)
            targets = eng._named_targets()
            assert all(torch.equal(targets[n], t) for n, t in named)
    finally:
        bs.close()
        eng.shutdown()


def test_offloaded_weights_refuse_and_resume_rebinds(model_dir):
    eng = EmbeddedEngine(model_dir, random_seed=0, offload_weights_on_release=True).start()
    bs, cache = shm.BoundSegment(), shm.SegmentCache()
    try:
        _bind(eng, bs, cache, perturbed_state_dict(eng.model, seed=60), "a")
        eng.release_memory().result(60)
        assert shared_weights.bound_parameters(eng) == []  # the views were dropped with the storage
        with pytest.raises(EngineError, match="released"):
            _bind(eng, bs, cache, perturbed_state_dict(eng.model, seed=61), "b")
        eng.resume_memory().result(60)
        named = perturbed_state_dict(load_reference_model(model_dir), seed=62)
        res = _bind(eng, bs, cache, named, "c")
        assert res["bound"] == len(named)
        params = dict(eng.model.named_parameters())
        assert all(torch.equal(params[n], t) for n, t in named)
    finally:
        bs.close()
        eng.shutdown()


# ------------------------------------------------------------------------------- over HTTP
SERVER_ARGS = {"update_waits_for_requests": True}  # the module's `server` (tests/engine_fixtures.py)


def test_tensor_sync_binds_checks_every_tensor_and_removes_its_segment(server, model_dir):
    base = load_reference_model(model_dir)
    sync = make_weight_sync("tensor", [server.url], timeout_s=60, check_equal=True)
    client = EngineClient(server.url, timeout_s=60)
    try:
        paths = []
        for i in range(3):
            named = perturbed_state_dict(base, seed=70 + i)
            report = sync.push(named, f"bind-{i}")  # --check-weight-update-equal: every tensor read back
            assert sync.last_mode == report["transport"] == "bind" and sync.segment is None
            assert sync.last_chunks == 1
            assert report["bytes"] == sum(t.numel() * t.element_size() for _, t in named)
            paths.append(sync.bound.segment.path)
        assert len(set(paths)) == 1 and os.path.exists(paths[0])
        # a failed push retires the segment (the engine may still apply it later) and changes nothing
        with pytest.raises(WeightSyncError, match=rf"engine {server.url}.*unknown parameter names"):
            sync.push([("nope", torch.ones(1))] + named, "bad")
        assert sync.bound.segment is None and not os.path.exists(paths[0])
        assert client.get_weight_version() == "bind-2"
        r = client.generate(PROMPT, {"temperature": 0.8, "max_new_tokens": 8, "ignore_eos": True}, return_logprob=True)
        ref = reference_with(model_dir, named)  # served from the removed file's pages, still mapped
        assert max_abs_diff(response_logprobs(r), reference_logprobs(ref, PROMPT, r["output_ids"], 0.8)) <= 1e-5
        sync.push(named, "after-bad")
        paths.append(sync.bound.segment.path)
        assert paths[-1] != paths[0]
    finally:
        sync.close()
        client.close()
    assert not any(os.path.exists(p) for p in paths)


def test_push_during_generation_waits_and_keeps_the_request_on_one_version(server, model_dir):
    """update_waits_for_requests: a push while a request runs is applied after it; the whole response comes
    from the weights it started with."""
    base = load_reference_model(model_dir)
    w1, w2 = perturbed_state_dict(base, seed=80), perturbed_state_dict(base, seed=81)
    client = EngineClient(server.url, timeout_s=120)
    with make_weight_sync("tensor", [server.url], timeout_s=120) as sync:
        sync.push(w1, "w1")
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", client.generate(
            PROMPT, {"temperature": 0.8, "max_new_tokens": 256, "ignore_eos": True}, return_logprob=True)))
        t.start()
        deadline = time.monotonic() + 60
        while client.server_info()["internal_states"][0]["num_running_reqs"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        sync.push(w2, "w2")
        t.join(120)
        assert sync.last_mode == "bind"
    r = out["r"]
    assert r["meta_info"]["weight_version"] == "w1" and client.get_weight_version() == "w2"
    ref = reference_with(model_dir, w1)
    assert max_abs_diff(response_logprobs(r), reference_logprobs(ref, PROMPT, r["output_ids"], 0.8)) <= 1e-5
    client.close()


def test_no_room_in_dev_shm_falls_back_to_two_copies(server, model_dir, monkeypatch):
    monkeypatch.setattr(shm, "shm_room", lambda directory=None: 1 << 20)
    with make_weight_sync("tensor", [server.url], timeout_s=60, check_equal=True) as sync:
        sync.push(perturbed_state_dict(load_reference_model(model_dir), seed=90), "chunked")
        assert sync.last_mode == "chunked" and sync.bound.segment is None


def test_bind_requests_need_the_key_and_a_relax_segment(server):
    body = {"serialized_named_tensors": ['{"segment": "/etc/passwd", "segment_bytes": 64, "tensors": []}'],
            "load_format": shm.LOAD_FORMAT_BIND}
    assert requests.post(server.url + "/update_weights_from_tensor", json=body, timeout=30).status_code == 401
    client = EngineClient(server.url, timeout_s=60)
    try:
        with pytest.raises(EngineRequestError, match="refusing to map '/etc/passwd'"):
            client._post("/update_weights_from_tensor", body)
        assert shm.LOAD_FORMAT_BIND in client.server_info()["weight_update_formats"]
    finally:
        client.close()


def test_a_run_pushes_with_one_copy(server, model_dir):
    """What the trainer role calls (`push_for_config`, --check-weight-update-equal on) takes this path."""
    named = perturbed_state_dict(load_reference_model(model_dir), seed=95)
    try:
        report = push_for_config(named, [server.url], 7, {"check_weight_update_equal": True,
                                                          "update_weight_buffer_size": 1 << 20})
        assert report["transport"] == "bind" and EngineClient(server.url).get_weight_version() == "7"
    finally:
        close_all()
