"""Shared-prompt prefill of the embedded engine (relax.backends.embedded.prefix): identical prompts admitted
together are prefilled once and their KV rows copied. Every result must equal the unshared prefill's (each copy
on its own row): greedy tokens, seeded and unseeded samples, output and prompt log-probs; `cached_tokens` reports
the reused prompt tokens; the fast tokenizer decode gives tokenizer.decode's text."""

import random

import pytest
import torch

from relax.backends.embedded.engine import EmbeddedEngine, EngineError
from relax.backends.embedded.requests import _fast_backend, text_decoder
from relax.backends.embedded.sampling import SamplingParams
from relax.backends.embedded.server import build_requests
from relax.backends.embedded.testing import max_abs_diff, reference_greedy, reference_logprobs, response_logprobs

torch.set_num_threads(1)

P = [5, 6, 7, 8, 9, 10, 11, 12, 13]
Q = [20, 21, 22, 23, 24]
R = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]


def _engine(model_dir, share: bool) -> EmbeddedEngine:
    return EmbeddedEngine(model_dir, random_seed=0, max_running_requests=64, share_prefill=share).start()


class _PrefillRows:
    """Rows of every prefill forward pass (input longer than one token) of an engine's model."""

    def __init__(self, engine):
        self.rows: list[int] = []
        engine.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            self.rows.append(int(ids.shape[0]))


def _generate(engine, specs):
    """Submit (prompt, sampling dict, request kwargs) specs together; their replies in order."""
    reqs = [engine.make_request(p, SamplingParams.from_dict(dict(sp)), **kw) for p, sp, kw in specs]
    return [f.result(60) for f in engine.submit_many(reqs)]


def _both(model_dir, specs):
    """The replies with sharing on, with it off (fresh engines, same seed), and the prefill rows of each."""
    out = {}
    for share in (True, False):
        eng = _engine(model_dir, share)
        rows = _PrefillRows(eng)
        try:
            out[share] = (_generate(eng, specs), rows.rows, dict(eng.stats))
        finally:
            eng.shutdown()
    return out[True], out[False]


def _assert_same(shared, unshared, tol=1e-5):
    assert len(shared) == len(unshared)
    for a, b in zip(shared, unshared):
        assert a["output_ids"] == b["output_ids"]
        assert a["text"] == b["text"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        if "output_token_logprobs" in a["meta_info"]:
            assert max_abs_diff(response_logprobs(a), response_logprobs(b)) <= tol
        ia, ib = a["meta_info"].get("input_token_logprobs"), b["meta_info"].get("input_token_logprobs")
        assert (ia is None) == (ib is None)
        if ia:
            assert [x[1] for x in ia] == [x[1] for x in ib]
            assert max_abs_diff([x[0] or 0.0 for x in ia], [x[0] or 0.0 for x in ib]) <= tol


def test_greedy_group_shares_rows_and_matches_unshared_and_reference(model_dir, ref):
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    specs = [(P, sp, {"return_logprob": True})] * 4 + [(Q, sp, {"return_logprob": True})] + \
        [(R, sp, {"return_logprob": True})] * 3
    (shared, rows_s, stats_s), (unshared, rows_u, stats_u) = _both(model_dir, specs)
    assert rows_s == [3] and rows_u == [8]  # one prefill row per distinct prompt
    _assert_same(shared, unshared)
    for (prompt, _, _), r in zip(specs, shared):
        assert r["output_ids"] == reference_greedy(ref, prompt, 12)
        assert max_abs_diff(response_logprobs(r), reference_logprobs(ref, prompt, r["output_ids"], 1.0)) <= 1e-5
    assert [r["meta_info"]["cached_tokens"] for r in shared] == [0, 9, 9, 9, 0, 0, 12, 12]
    assert all(r["meta_info"]["cached_tokens"] == 0 for r in unshared)
    assert stats_s["num_cached_tokens"] == 3 * 9 + 2 * 12 and stats_u["num_cached_tokens"] == 0
    assert stats_s["num_prompt_tokens"] == stats_u["num_prompt_tokens"] == 4 * 9 + 5 + 3 * 12


def test_sampling_per_copy_is_unchanged_by_sharing(model_dir):
    """Seeded copies draw with their own seeds, unseeded ones from the engine's generator in row order: the same
    tokens as when every copy is prefilled on its own row."""
    seeded = [(P, {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 100 + j},
               {"return_logprob": True}) for j in range(6)]
    unseeded = [(R, {"temperature": 0.9, "top_k": 40, "max_new_tokens": 10, "ignore_eos": True},
                 {"return_logprob": True}) for _ in range(6)]
    specs = seeded[:3] + unseeded[:3] + seeded[3:] + unseeded[3:]
    (shared, rows_s, _), (unshared, _, _) = _both(model_dir, specs)
    assert rows_s == [2]
    _assert_same(shared, unshared)
    assert len({tuple(r["output_ids"]) for r in shared[:3]}) > 1  # copies really sample apart


def test_mixed_group_prompt_logprobs_lengths_and_prompt_only_requests(model_dir, ref):
    """Copies that ask for prompt log-probs (read from the shared row), copies with other sampling settings,
    a prompt-log-prob-only request (max_new_tokens 0) and prompts of different lengths, in one group."""
    g = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    specs = [
        (R, g, {"return_logprob": True}),
        (R, g, {"return_logprob": True, "logprob_start_len": 0}),
        (Q, g, {"return_logprob": True, "logprob_start_len": 2}),
        (R, {"temperature": 0.7, "max_new_tokens": 0}, {"return_logprob": True, "logprob_start_len": 0}),
        (Q, {"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 3},
         {"return_logprob": True, "top_logprobs_num": 3}),
        (P, g, {}),
        (R, g, {"return_logprob": True, "logprob_start_len": 4, "top_logprobs_num": 2}),
    ]
    (shared, rows_s, _), (unshared, rows_u, _) = _both(model_dir, specs)
    assert rows_s == [3] and rows_u == [7]
    _assert_same(shared, unshared)
    assert shared[3]["output_ids"] == [] and len(shared[3]["meta_info"]["input_token_logprobs"]) == len(R)
    # prompt log-probs of a copy equal a plain forward pass of its prompt (temperature 0.7 for request 3)
    for i, t in ((1, 1.0), (3, 0.7)):
        got = [x[0] for x in shared[i]["meta_info"]["input_token_logprobs"][1:]]
        assert max_abs_diff(got, reference_logprobs(ref, R[:1], R[1:], t)) <= 1e-5
    assert [x[1] for x in shared[6]["meta_info"]["input_token_logprobs"]] == R[4:]
    for i in (4, 6):
        top_s, top_u = shared[i]["meta_info"]["output_top_logprobs"], unshared[i]["meta_info"]["output_top_logprobs"]
        assert [[x[1] for x in row] for row in top_s] == [[x[1] for x in row] for row in top_u]
        assert max_abs_diff([x[0] for row in top_s for x in row], [x[0] for row in top_u for x in row]) <= 1e-5
    assert [r["meta_info"]["cached_tokens"] for r in shared] == [0, 12, 0, 12, 5, 0, 12]


def test_batched_body_of_four_copies_and_a_distinct_prompt_reports_cached_tokens(model_dir):
    """A /generate body as the server parses it: four identical prompts and a distinct one, seeded per prompt."""
    body = {"input_ids": [P, P, P, P, Q], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0},
            "return_logprob": True, "custom_labels": {"sampling_seeds": "1,2,3,4,5"}}
    replies = {}
    for share in (True, False):
        eng = _engine(model_dir, share)
        try:
            reqs, is_batch = build_requests(eng, body)
            replies[share] = [f.result(60) for f in eng.submit_many(reqs)]
        finally:
            eng.shutdown()
    assert [r["meta_info"]["cached_tokens"] for r in replies[True]] == [0, 9, 9, 9, 0]
    assert [r["meta_info"]["cached_tokens"] for r in replies[False]] == [0] * 5
    _assert_same(replies[True], replies[False])


def test_submit_many_is_all_or_nothing(model_dir):
    eng = _engine(model_dir, True)
    try:
        sp = SamplingParams.from_dict({"max_new_tokens": 2})
        a, b = eng.make_request(P, sp, rid="x"), eng.make_request(P, SamplingParams.from_dict({}), rid="x")
        with pytest.raises(EngineError, match="duplicate"):
            eng.submit_many([a, b])
        assert eng.num_waiting() == 0 and not a.future.done()
        assert len(eng.submit_many([a])[0].result(60)["output_ids"]) <= 2
    finally:
        eng.shutdown()


def test_fast_decode_gives_tokenizer_decode_text(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert _fast_backend(tok) is not None  # the fast path is what runs
    decode = text_decoder(tok)
    rng = random.Random(0)
    specials = sorted(tok.all_special_ids)
    vocab = len(tok)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        if specials and rng.random() < 0.5:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        for skip in (True, False):
            assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)
    tok.clean_up_tokenization_spaces = True  # a clean-up the backend does not do: the stock decode runs
    assert _fast_backend(tok) is None


def test_routed_experts_of_copies_are_those_of_their_own_prefill(tmp_path):
    """R3 (`return_routed_experts`) on a tiny Qwen3-MoE: a copy's prompt routes are read from the shared row and
    equal those of an unshared prefill; decode steps stay per request."""
    import json

    from relax.backends.embedded.routing import META_KEY
    from relax.backends.megatron.testing import build_random_tiny_moe_model
    from relax.models.tiny import build_byte_tokenizer

    path = build_random_tiny_moe_model(tmp_path / "moe", seed=7)
    tok = build_byte_tokenizer()
    tok.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    (path / "config.json").write_text(json.dumps(cfg))
    sp = {"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True}
    specs = [(P, dict(sp, sampling_seed=j), {"return_logprob": True, "return_routed_experts": j != 1})
             for j in range(3)] + [(Q, dict(sp, sampling_seed=9), {"return_routed_experts": True})]
    (shared, rows_s, _), (unshared, _, _) = _both(str(path), specs)
    assert rows_s == [2]
    _assert_same(shared, unshared)
    for a, b in zip(shared, unshared):
        assert a["meta_info"].get(META_KEY) == b["meta_info"].get(META_KEY)
    assert META_KEY not in shared[1]["meta_info"] and shared[2]["meta_info"][META_KEY]
