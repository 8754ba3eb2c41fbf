"""The shared-memory weight path (`relax.weights.shm`, `load_format="relax_shm"`): chunking and double
buffering against real /dev/shm files, the engine-side reader's checks, and `TensorSync` against a real
embedded engine (versions, --check-weight-update-equal, served log-probs, errors naming the engine,
the segment reused across pushes and removed on close)."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine_fixtures import assert_engine_serves

from relax.backends.embedded.testing import load_reference_model, perturbed_state_dict
from relax.wire.engine_client import EngineClient
from relax.weights import shm
from relax.weights.sync import TensorSync, WeightSyncError, make_weight_sync


def _tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("a", torch.randn(37, 11, generator=g).to(torch.bfloat16)),
        ("b", torch.randn(1000, generator=g)),  # bigger than a slot: split over chunks
        ("empty", torch.zeros(0, 4)),
        ("c", torch.randint(-5, 5, (3, 7), generator=g, dtype=torch.int64)),
        ("d", torch.randn(5, 9, generator=g).t()),  # not contiguous
        ("e", torch.randn(2, 3, generator=g, dtype=torch.float64).to(torch.float16)),
    ]


def _receive_into(out: dict, cache: shm.SegmentCache, data: str, delay_s: float = 0.0) -> None:
    """What the engine does: views on the segment copied into full-size destination tensors."""
    time.sleep(delay_s)  # the sender writes the other slot meanwhile
    for name, shape, start, view in shm.manifest_views(shm.parse_manifest(data), cache):
        dst = out.setdefault(name, torch.full(shape, -7, dtype=view.dtype))
        dst.view(-1)[start:start + view.numel()].copy_(view)


@pytest.mark.parametrize("slot", [64, 256, 1 << 20])
def test_pack_chunks_roundtrip_is_exact_and_slots_are_not_overwritten_in_flight(slot):
    named = _tensors()
    seg = shm.ShmSegment(2 * slot)
    cache, out, sent, ex = shm.SegmentCache(), {}, [], ThreadPoolExecutor(1)
    in_flight = threading.Semaphore(1)

    def send(entries, last):
        assert in_flight.acquire(blocking=False), "two chunks in flight at once"
        data = shm.manifest(seg, entries)
        sent.append((entries, last))

        def work():
            try:
                _receive_into(out, cache, data, delay_s=0.01)
            finally:
                in_flight.release()

        return ex.submit(work)

    try:
        report = shm.pack_chunks(named, seg.buf, slot, send)
    finally:
        ex.shutdown()
        seg.close()
    assert not os.path.exists(seg.path)
    assert [last for _, last in sent] == [False] * (len(sent) - 1) + [True]
    assert report["chunks"] == len(sent) and report["tensors"] == len(named)
    assert report["bytes"] == sum(t.numel() * t.element_size() for _, t in named)
    if slot == 64:
        assert len(sent) > 10  # small slots: "b" alone takes 4000 bytes
    if slot == 1 << 20:
        assert len(sent) == 1
    for entries, _ in sent:  # every piece lies inside one slot, aligned
        for name, dname, shape, start, numel, offset in entries:
            es = torch.empty((), dtype=getattr(torch, dname)).element_size()
            assert offset % shm.ALIGN == 0 and offset // slot == (offset + max(numel * es - 1, 0)) // slot
    for name, t in named:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name


def test_pack_chunks_raises_what_the_engine_raised_and_waits_for_the_chunk_in_flight():
    seg = shm.ShmSegment(2 * 256)
    ex = ThreadPoolExecutor(1)
    done, fail = [], [True]

    def send(entries, last):
        def work():
            time.sleep(0.05)
            done.append(len(done))
            if fail[0] and len(done) == 2:
                raise RuntimeError("engine http://x:1 said no")

        return ex.submit(work)

    try:
        with pytest.raises(RuntimeError, match="http://x:1 said no"):
            shm.pack_chunks(_tensors(), seg.buf, 256, send)
        assert len(done) == 2  # stopped at the failing chunk
        done.clear()
        fail[0] = False
        # an error while writing (a dtype the path cannot carry) waits for the chunk in flight first
        with pytest.raises(ValueError, match="cannot travel"):
            shm.pack_chunks([*_tensors()[:2], ("z", torch.zeros(2, dtype=torch.complex64))], seg.buf, 256, send)
        assert len(done) >= 1 and ex._work_queue.empty()
    finally:
        ex.shutdown()
        seg.close()


def test_slot_size_follows_the_buffer_budget_and_the_update():
    big = [("w", torch.empty(64 << 20, dtype=torch.uint8))]
    assert shm.slot_bytes_for(big, 512 << 20) == 8 << 20  # 1/8 of the update
    assert shm.slot_bytes_for(big, 4 << 20) == 2 << 20  # two slots within the budget
    small = [("w", torch.empty(1000, dtype=torch.float32))]
    assert shm.slot_bytes_for(small, 512 << 20) == 4032  # no more than the update needs (aligned)
    assert shm.slot_bytes_for([("w", torch.empty(3, dtype=torch.float64))], 2) == shm.ALIGN


def test_reader_refuses_foreign_files_and_out_of_range_pieces(tmp_path):
    cache = shm.SegmentCache()
    foreign = tmp_path / "secrets"
    foreign.write_bytes(b"x" * 128)
    with pytest.raises(ValueError, match="refusing to map"):
        cache.get(str(foreign), 128)
    with pytest.raises(ValueError, match="does not exist"):
        cache.get(os.path.join(shm.shm_dir(), shm.PREFIX + "gone"), 128)
    seg = shm.ShmSegment(256)
    try:
        ok = {"segment": seg.path, "segment_bytes": seg.nbytes, "tensors": [["w", "float32", [4], 0, 4, 64]]}
        assert [v.numel() for *_, v in shm.manifest_views(ok, cache)] == [4]
        for bad in (["w", "float32", [4], 0, 4, seg.nbytes - 8], ["w", "float32", [4], 0, 4, 2],
                    ["w", "complex_thing", [4], 0, 4, 0]):
            with pytest.raises(ValueError):
                list(shm.manifest_views({**ok, "tensors": [bad]}, cache))
        with pytest.raises(ValueError, match="manifest"):
            shm.parse_manifest('{"tensors": 3}')
    finally:
        seg.close()
    assert shm.shm_capable({"weight_update_formats": [None, "relax_shm"]})
    assert not shm.shm_capable({"version": "0.5.23"})


# ------------------------------------------------------------------------- against a real engine
def test_tensor_sync_uses_one_reused_segment_and_the_engine_serves_the_new_weights(server, model_dir):
    base = load_reference_model(model_dir)
    sync = make_weight_sync("tensor", [server.url], buffer_bytes=64 << 10, timeout_s=60, check_equal=True,
                            shm_mode="chunked")  # the two-copy path (the one-copy one: test_weightsync_bind.py)
    assert isinstance(sync, TensorSync)
    try:
        paths = []
        for i in range(2):
            named = perturbed_state_dict(base, seed=40 + i)
            report = sync.push(named, f"shm-{i}")  # check_equal reads every tensor back
            assert sync.segment is not None and sync.segment.nbytes <= 64 << 10
            assert sync.last_chunks > 2  # 64 KiB budget: many chunks, big tensors split
            paths.append(sync.segment.path)
            assert report["bytes"] == sum(t.numel() * t.element_size() for _, t in named)
            assert_engine_serves(server.url, model_dir, named, f"shm-{i}")
        assert paths[0] == paths[1] and os.path.exists(paths[0])
    finally:
        sync.close()
    assert not os.path.exists(paths[0])
    # the engine dropped nothing it needs: a new sync (new segment) still works
    with make_weight_sync("tensor", [server.url], timeout_s=60, shm_mode="chunked") as again:
        again.push(perturbed_state_dict(base, seed=50), "shm-again")
        assert again.last_chunks >= 1 and again.last_mode == "chunked"
    assert EngineClient(server.url).get_weight_version() == "shm-again"


def test_shm_and_pickle_paths_leave_identical_weights(server, model_dir):
    base = load_reference_model(model_dir)
    named = perturbed_state_dict(base, seed=60)
    client = EngineClient(server.url, timeout_s=60)
    held = {}
    for mode in ("chunked", "bind", "pickle"):
        with make_weight_sync("tensor", [server.url], buffer_bytes=32 << 10, timeout_s=60,
                              use_shm=mode != "pickle", shm_mode=None if mode == "pickle" else mode) as sync:
            sync.push(named, f"same-{mode}")
            assert sync.last_mode == mode and (sync.segment is not None) == (mode == "chunked")
        held[mode] = {n: torch.tensor(client.get_weights_by_name(n, truncate_size=t.numel()), dtype=torch.float64)
                      for n, t in named[:6]}
    client.close()
    for n in held["chunked"]:
        assert torch.equal(held["chunked"][n], held["pickle"][n]), n
        assert torch.equal(held["bind"][n], held["pickle"][n]), n


def test_shm_errors_name_the_engine_and_change_nothing(server, model_dir):
    base = load_reference_model(model_dir)
    named = perturbed_state_dict(base, seed=70)
    client = EngineClient(server.url, timeout_s=60)
    with make_weight_sync("tensor", [server.url], timeout_s=60) as sync:
        sync.push(named, "before")
        bad = [(n + ".nope" if i == 0 else n, t + 1) for i, (n, t) in enumerate(named)]
        with pytest.raises(WeightSyncError, match=rf"engine {server.url}.*unknown parameter names.*nope"):
            sync.push(bad, "after")
        wrong = [(n, t[:1] if i == 1 else t) for i, (n, t) in enumerate(named)]
        with pytest.raises(WeightSyncError, match=rf"engine {server.url}.*shape mismatch"):
            sync.push(wrong, "after")
    assert client.get_weight_version() == "before"
    n0, t0 = named[1]
    got = torch.tensor(client.get_weights_by_name(n0, truncate_size=t0.numel()), dtype=torch.float64)
    assert torch.equal(got.flatten(), t0.double().flatten())  # one chunk (default budget): nothing changed
    # a manifest naming a foreign file is refused by the engine
    from relax.wire.engine_client import EngineRequestError

    with pytest.raises(EngineRequestError, match="refusing to map '/etc/passwd'"):
        client._post("/update_weights_from_tensor", {
            "serialized_named_tensors": ['{"segment": "/etc/passwd", "segment_bytes": 64, "tensors": []}'],
            "load_format": "relax_shm"})
    client.close()


def test_segments_of_dead_senders_are_swept(tmp_path):
    import subprocess
    import sys

    # a sender killed before it could close (as a killed trainer actor): its segment stays behind ...
    code = ("import os, sys; from relax.weights import shm; s = shm.ShmSegment(4096, sys.argv[1]); "
            "print(s.path, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    dead = out.stdout.strip()
    assert os.path.exists(dead) and os.path.basename(dead).startswith(shm.PREFIX)
    mine = shm.ShmSegment(4096, str(tmp_path))
    try:
        # ... until the next sender on the host starts: the dead one's file is gone, a live one's stays
        assert not os.path.exists(dead) and os.path.exists(mine.path)
        assert shm.sweep_stale_segments(str(tmp_path)) == []
    finally:
        mine.close()
    assert not os.path.exists(mine.path)
