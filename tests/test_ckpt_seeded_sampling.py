"""Reproducible rollouts across a restart: a request with SGLang's `sampling_seed` samples the same tokens in
the embedded engine whatever else is batched with it (and after an abort + resume with the same seed), and
relax.rollout.generate derives the seeds from --rollout-seed, the step and the sample."""

import asyncio

import pytest
import torch

from conftest import shared_tiny_model

from relax.backends.embedded.engine import EmbeddedEngine
from relax.backends.embedded.sampling import SamplingParams
from relax.rollout import generate as gen

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = str(shared_tiny_model())
    eng = EmbeddedEngine(path, random_seed=0, max_running_requests=16).start()
    yield eng
    eng.shutdown()


def _params(seed, n=12, **kw):
    return SamplingParams.from_dict({"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True,
                                     "sampling_seed": seed, **kw})


def test_seeded_request_ignores_batching(engine):
    prompt = [7, 8, 9, 10]
    alone = engine.submit(engine.make_request(prompt, _params(42), return_logprob=True)).result(60)
    # the same request among others of different lengths, some seeded, some not, submitted at once
    others = [engine.make_request([3] * k, _params(None if k % 2 else k, n=5 + k)) for k in range(1, 7)]
    target = engine.make_request(prompt, _params(42), return_logprob=True)
    futures = [engine.submit(r) for r in others[:3]] + [engine.submit(target)] + [engine.submit(r) for r in others[3:]]
    batched = futures[3].result(60)
    for f in futures:
        f.result(60)
    assert batched["output_ids"] == alone["output_ids"]
    assert max(abs(a[0] - b[0]) for a, b in zip(batched["meta_info"]["output_token_logprobs"],
                                                 alone["meta_info"]["output_token_logprobs"])) < 1e-4
    other = engine.submit(engine.make_request(prompt, _params(43))).result(60)
    assert other["output_ids"] != alone["output_ids"]


def test_seeded_request_resumes_identically(engine):
    prompt = [11, 12, 13]
    full = engine.submit(engine.make_request(prompt, _params(5, n=12))).result(60)["output_ids"]
    first = full[:5]  # an aborted request resumed from prompt + its partial response, same seed
    rest = engine.submit(engine.make_request(prompt + first, _params(5, n=7))).result(60)["output_ids"]
    assert first + rest == full


def test_generate_derives_per_sample_seeds():
    from relax.data.sample import Sample

    seeds = {gen.sample_seed(1, step, group, slot) for step in range(3) for group in range(3) for slot in range(4)}
    assert len(seeds) == 36 and all(0 <= s < 2 ** 31 for s in seeds)
    assert gen.sample_seed(1, 2, 3, 0) == gen.sample_seed(1, 2, 3, 0) != gen.sample_seed(2, 2, 3, 0)

    sent = []

    async def fake_call(session, url, input_ids, sampling, **kw):
        sent.append(sampling.get("sampling_seed"))
        return gen.EngineReply(tokens=[1], logprobs=[-0.1], text="x", finish="length")

    orig_call, orig_seed = gen.call_engine, gen._ROLLOUT_SEED
    gen.call_engine = fake_call
    try:
        gen.set_rollout_seed(1234)
        gen._SLOTS.clear()  # slots handed out by rollouts of earlier tests in this process

        async def run(step):
            group = [Sample(group_index=9, prompt_tokens=[1, 2], rollout_step=step) for _ in range(4)]
            await asyncio.gather(*(gen.generate_one(None, "http://x", s, {"max_new_tokens": 1}) for s in group))

        asyncio.run(run(5))
        first, sent[:] = list(sent), []
        gen._SLOTS.clear()  # a restarted process
        asyncio.run(run(5))
        assert sent == first == [gen.sample_seed(1234, 5, 9, k) for k in range(4)]
    finally:
        gen.call_engine, gen._ROLLOUT_SEED = orig_call, orig_seed
