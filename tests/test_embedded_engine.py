"""The embedded engine core in-process (no HTTP): batching, KV-cache merging, stops, aborts, pause,
weight updates at step boundaries."""

import threading
import time

import pytest
import torch

from relax.backends.embedded.engine import EmbeddedEngine, EngineError
from relax.backends.embedded.sampling import SamplingParams
from relax.backends.embedded.testing import (
    max_abs_diff,
    perturbed_state_dict,
    reference_greedy,
    reference_logprobs,
    response_logprobs,
)

torch.set_num_threads(1)


@pytest.fixture()
def engine(model_dir):
    eng = EmbeddedEngine(model_dir, random_seed=0, max_running_requests=16).start()
    try:
        yield eng
    finally:
        eng.shutdown()


def sp(**kw):
    kw.setdefault("ignore_eos", True)
    return SamplingParams.from_dict(kw)


def run(engine, prompt, timeout=60, **kw):
    rl = kw.pop("return_logprob", True)
    return engine.submit(engine.make_request(prompt, sp(**kw), return_logprob=rl)).result(timeout)


def test_staggered_requests_merge_into_running_batch_exactly(engine, ref):
    """Requests joining a running batch (KV caches left-padded and merged) keep exact log-probs."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34], [40] * 17, [7]]
    futures = []
    for i, p in enumerate(prompts):
        req = engine.make_request(p, sp(max_new_tokens=60 - 5 * i, temperature=0.8), return_logprob=True)
        futures.append((p, engine.submit(req)))
        while len(req.output_ids) < 2:  # it runs; the next one must join a running batch
            time.sleep(0.001)
    sizes = []
    for p, f in futures:
        r = f.result(60)
        sizes.append(len(r["output_ids"]))
        assert len(r["output_ids"]) == r["meta_info"]["completion_tokens"] > 0
        exp = reference_logprobs(ref, p, r["output_ids"], 0.8)
        assert max_abs_diff(response_logprobs(r), exp) <= 1e-5
    assert sizes == [60 - 5 * i for i in range(len(prompts))]


def test_greedy_matches_reference_and_is_batch_invariant(engine, ref):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    alone = run(engine, prompt, temperature=0, max_new_tokens=24)
    assert alone["output_ids"] == reference_greedy(ref, prompt, 24)
    futs = [engine.submit(engine.make_request(p, sp(temperature=0, max_new_tokens=24)))
            for p in ([9] * 30, prompt, [1, 2])]
    assert futs[1].result(60)["output_ids"] == alone["output_ids"]
    for f in futs:
        f.result(60)


def test_min_new_tokens_suppresses_stop_but_logprobs_stay_unmasked(engine, ref):
    prompt = [11, 12, 13]
    first = run(engine, prompt, temperature=0, max_new_tokens=1)
    tok = first["output_ids"][0]
    r = run(engine, prompt, temperature=0, max_new_tokens=5, min_new_tokens=3, stop_token_ids=[tok],
            ignore_eos=True)
    assert r["output_ids"][0] != tok and len(r["output_ids"]) >= 3
    assert max_abs_diff(response_logprobs(r), reference_logprobs(ref, prompt, r["output_ids"], 1.0)) <= 1e-5


def test_eos_stops_and_is_trimmed_from_text(model_dir):
    eng = EmbeddedEngine(model_dir, random_seed=0).start()
    try:
        prompt = [21, 22, 23]
        first = run(eng, prompt, temperature=0, max_new_tokens=1)["output_ids"][0]
        eos = eng.tokenizer.eos_token_id
        w = eng.model.lm_head.weight.detach().clone()
        w[[first, eos]] = w[[eos, first]]  # the greedy first token's logit now belongs to eos
        eng.update_weights([("lm_head.weight", w)], "swapped").result(10)
        r = eng.submit(eng.make_request(prompt, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 5}),
                                        return_logprob=True)).result(30)
        assert r["output_ids"] == [eos] and r["text"] == ""
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
        assert r["meta_info"]["weight_version"] == "swapped"
        ignored = run(eng, prompt, temperature=0, max_new_tokens=5, ignore_eos=True)
        assert len(ignored["output_ids"]) == 5 and ignored["output_ids"][0] == eos
    finally:
        eng.shutdown()


def test_sampling_seed_is_reproducible(engine):
    a = run(engine, [1, 2, 3], temperature=1.0, max_new_tokens=16, sampling_seed=7)
    b = run(engine, [1, 2, 3], temperature=1.0, max_new_tokens=16, sampling_seed=7)
    c = run(engine, [1, 2, 3], temperature=1.0, max_new_tokens=16, sampling_seed=8)
    assert a["output_ids"] == b["output_ids"] != c["output_ids"]


def test_top_k_one_is_greedy_and_top_p_small_is_greedy(engine):
    g = run(engine, [4, 5, 6], temperature=0, max_new_tokens=10)["output_ids"]
    assert run(engine, [4, 5, 6], temperature=1.3, top_k=1, max_new_tokens=10)["output_ids"] == g
    assert run(engine, [4, 5, 6], temperature=1.0, top_p=1e-6, max_new_tokens=10)["output_ids"] == g


def test_abort_running_request_returns_partial_output(engine):
    req = engine.make_request([1, 2, 3], sp(max_new_tokens=400), return_logprob=True, rid="long-one")
    fut = engine.submit(req)
    while len(req.output_ids) < 3:
        time.sleep(0.005)
    engine.abort(rid="long-one")
    r = fut.result(30)
    assert r["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 <= len(r["output_ids"]) < 400
    assert len(r["meta_info"]["output_token_logprobs"]) == len(r["output_ids"])


def test_pause_in_place_freezes_and_update_applies_between_steps(engine, model_dir):
    req = engine.make_request([1, 2, 3], sp(max_new_tokens=300, temperature=0))
    fut = engine.submit(req)
    while len(req.output_ids) < 2:
        time.sleep(0.005)
    engine.pause("in_place")
    engine.call(lambda: None).result(10)  # a step boundary has passed
    n = len(req.output_ids)
    time.sleep(0.2)
    assert len(req.output_ids) == n and not fut.done()
    new = perturbed_state_dict(engine.model, seed=3)
    res = engine.update_weights(new, weight_version="v2").result(10)  # applies while paused
    assert res["num_tensors"] == len(new) and engine.weight_version == "v2"
    engine.resume()
    r = fut.result(60)
    assert r["meta_info"]["finish_reason"]["type"] == "length"
    assert r["meta_info"]["weight_version"] == "v2"


def test_bad_weight_update_changes_nothing(engine):
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    good = [("model.norm.weight", torch.zeros_like(before["model.norm.weight"]))]
    with pytest.raises(EngineError, match="unknown parameter"):
        engine.update_weights(good + [("model.nope.weight", torch.zeros(3))], "x").result(10)
    with pytest.raises(EngineError, match="shape mismatch"):
        engine.update_weights(good + [("lm_head.weight", torch.zeros(3, 3))], "x").result(10)
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, before[n])
    assert engine.weight_version == "default"


def test_update_waits_for_requests_mode(model_dir):
    eng = EmbeddedEngine(model_dir, random_seed=0, update_waits_for_requests=True).start()
    try:
        req = eng.make_request([1, 2], sp(max_new_tokens=60, temperature=0))
        fut = eng.submit(req)
        while not req.output_ids:
            time.sleep(0.002)
        upd = eng.update_weights(perturbed_state_dict(eng.model, seed=4), weight_version="w1")
        r = fut.result(60)
        upd.result(60)
        assert r["meta_info"]["weight_version"] == "default"  # one version for the whole request
        assert eng.weight_version == "w1"
    finally:
        eng.shutdown()


def test_release_refuses_generation_until_resume(engine):
    engine.release_memory().result(10)
    with pytest.raises(EngineError) as e:
        engine.submit(engine.make_request([1], sp(max_new_tokens=2)))
    assert e.value.status == 503
    engine.resume_memory().result(10)
    assert len(run(engine, [1], max_new_tokens=2)["output_ids"]) == 2


def test_input_validation(engine):
    with pytest.raises(EngineError):
        engine.make_request([], sp())
    with pytest.raises(EngineError):
        engine.make_request([10_000], sp())
    with pytest.raises(EngineError):
        engine.make_request([1] * engine.context_length, sp())
    with pytest.raises(ValueError):
        SamplingParams.from_dict({"top_p": 0})
    with pytest.raises(ValueError):
        SamplingParams.from_dict({"repetition_penalty": 1.2})
    with pytest.raises(ValueError):
        SamplingParams.from_dict({"bogus": 1})
    # max_new_tokens is clipped to the context length
    req = engine.make_request([1] * (engine.context_length - 3), sp(max_new_tokens=50))
    assert req.params.max_new_tokens == 3


def test_concurrent_submitters(engine):
    results = []

    def worker(i):
        results.append(run(engine, [i + 1, i + 2], max_new_tokens=8))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 12 and all(len(r["output_ids"]) == 8 for r in results)


def test_failed_step_fails_its_requests_and_engine_keeps_serving(engine):
    real = engine._decode_step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real()

    engine._decode_step = flaky
    r = run(engine, [1, 2], max_new_tokens=10)
    assert r["meta_info"]["finish_reason"]["type"] == "abort"
    assert "injected" in r["meta_info"]["finish_reason"]["message"]
    assert len(run(engine, [1, 2], max_new_tokens=10)["output_ids"]) == 10
    assert engine.is_alive()


def test_offload_weights_on_release_then_update(model_dir):
    eng = EmbeddedEngine(model_dir, random_seed=0, offload_weights_on_release=True).start()
    try:
        before = run(eng, [1, 2, 3], temperature=0, max_new_tokens=8)["output_ids"]
        saved = [(n, p.detach().clone()) for n, p in eng.model.named_parameters()]
        eng.release_memory(["weights", "kv_cache"]).result(10)
        assert all(p.numel() == 0 for p in eng.model.parameters())
        eng.resume_memory().result(10)
        assert all(p.numel() > 0 for p in eng.model.parameters())
        eng.update_weights(saved, "restored").result(10)
        assert run(eng, [1, 2, 3], temperature=0, max_new_tokens=8)["output_ids"] == before
    finally:
        eng.shutdown()
