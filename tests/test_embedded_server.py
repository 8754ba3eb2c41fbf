"""The embedded engine over HTTP: SGLang's /generate schema, log-probs against a plain HF forward,
stops, aborts, pause, memory release, info endpoints, and EngineClient errors."""

import concurrent.futures as cf
import time

import pytest
import requests

from relax.backends.embedded.launcher import EmbeddedServerProcess
from relax.backends.embedded.testing import max_abs_diff, reference_greedy, reference_logprobs, response_logprobs
from relax.wire.engine_client import EngineClient, EngineRequestError

T = 30  # seconds, per HTTP call


@pytest.fixture(scope="module")
def server(model_dir):
    proc = EmbeddedServerProcess(model_dir, server_args={"random_seed": 0, "max_running_requests": 32})
    proc.start()
    try:
        proc.wait_healthy(90)
        yield proc
    finally:
        proc.stop()
    assert not proc.is_alive()


@pytest.fixture(scope="module")
def client(server):
    c = EngineClient(server.url, timeout_s=T)
    yield c
    c.close()


def wait_running(server, n, timeout=T):
    deadline = time.monotonic() + timeout
    while True:
        load = requests.get(server.url + "/get_load", timeout=T).json()[0]
        if load["num_reqs"] - load["num_waiting_reqs"] >= n:
            return
        assert time.monotonic() < deadline, load
        time.sleep(0.01)


def gen(server, **body):
    r = requests.post(server.url + "/generate", json=body, timeout=T)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_single_generate_logprobs_match_hf(server, ref, temperature):
    prompt = [5, 17, 99, 23, 42]
    r = gen(server, input_ids=prompt, return_logprob=True,
            sampling_params={"temperature": temperature, "max_new_tokens": 24, "ignore_eos": True})
    meta = r["meta_info"]
    assert set(r) >= {"text", "output_ids", "meta_info"}
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 24 == len(r["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["weight_version"] == "default" and meta["id"]
    assert [x[1] for x in meta["output_token_logprobs"]] == r["output_ids"]
    assert all(x[2] is None for x in meta["output_token_logprobs"])
    assert max_abs_diff(response_logprobs(r), reference_logprobs(ref, prompt, r["output_ids"], temperature)) <= 1e-5


def test_batched_generate_logprobs_match_hf(server, ref):
    prompts = [[1, 2, 3], [50] * 11, [200, 201, 202, 203, 204, 205], [7]]
    sps = [{"temperature": t, "max_new_tokens": m, "ignore_eos": True}
           for t, m in ((1.0, 20), (0.7, 13), (1.0, 31), (0.0, 9))]
    out = gen(server, input_ids=prompts, sampling_params=sps, return_logprob=True)
    assert isinstance(out, list) and len(out) == 4
    for p, s, r in zip(prompts, sps, out):
        assert len(r["output_ids"]) == s["max_new_tokens"]
        exp = reference_logprobs(ref, p, r["output_ids"], s["temperature"])
        assert max_abs_diff(response_logprobs(r), exp) <= 1e-5


def test_greedy_equals_hf_greedy(server, ref):
    prompt = [31, 41, 59, 26, 53]
    r = gen(server, input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 30, "ignore_eos": True})
    assert r["output_ids"] == reference_greedy(ref, prompt, 30)


def test_text_input_and_n_samples(server, model_dir):
    r = gen(server, text="hello", sampling_params={"max_new_tokens": 4, "n": 3, "ignore_eos": True})
    assert isinstance(r, list) and len(r) == 3 and all(x["meta_info"]["prompt_tokens"] == 5 for x in r)
    r = gen(server, text=["ab", "cde"], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert [x["meta_info"]["prompt_tokens"] for x in r] == [2, 3]


def test_n_copies_share_one_prefill_and_report_cached_tokens(server, ref):
    """SGLang's `n` (a GRPO group): the copies' prompt is prefilled once (prefix.py); each copy past the first
    reports its whole prompt in `cached_tokens`, and the answers are what a plain forward pass gives."""
    prompt = [9, 8, 7, 6, 5, 4]
    out = gen(server, input_ids=[prompt, [3, 4]], return_logprob=True,
              sampling_params={"max_new_tokens": 5, "n": 4, "temperature": 1.0, "ignore_eos": True})
    assert [r["meta_info"]["cached_tokens"] for r in out] == [0, 6, 6, 6, 0, 2, 2, 2]
    for p, r in zip([prompt] * 4 + [[3, 4]] * 4, out):
        assert r["meta_info"]["prompt_tokens"] == len(p)
        assert max_abs_diff(response_logprobs(r), reference_logprobs(ref, p, r["output_ids"], 1.0)) <= 1e-5
    info = requests.get(server.url + "/get_server_info", timeout=T).json()
    assert info["disable_radix_cache"] is False and info["internal_states"][0]["num_cached_tokens"] >= 3 * 6 + 3 * 2


def test_max_new_tokens_and_stop_token_ids(server):
    prompt = [9, 8, 7]
    base = gen(server, input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    ids = base["output_ids"]
    stop_tok = ids[4]
    first = ids.index(stop_tok)
    r = gen(server, input_ids=prompt, return_logprob=True,
            sampling_params={"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [stop_tok], "ignore_eos": True})
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert r["output_ids"] == ids[: first + 1]  # the stop token is kept in output_ids ...
    assert len(r["meta_info"]["output_token_logprobs"]) == first + 1
    r0 = gen(server, input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 0})
    assert r0["output_ids"] == [] and r0["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_strings(server):
    # Byte-level tokenizer: decode the greedy continuation, pick a substring as a stop string.
    prompt = [72, 101, 108, 108, 111]
    base = gen(server, input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 20, "ignore_eos": True,
                                                        "skip_special_tokens": False})
    text = base["text"]
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].isprintable() and text[i:i + 2].strip())
    r = gen(server, input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 20, "stop": [stop],
                                                     "ignore_eos": True, "skip_special_tokens": False})
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert r["text"] == text[: text.index(stop)]
    assert len(r["output_ids"]) < 20
    keep = gen(server, input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 20, "stop": stop,
                                                        "no_stop_trim": True, "ignore_eos": True,
                                                        "skip_special_tokens": False})
    assert keep["text"].endswith(stop) or stop in keep["text"]


def test_abort_request_over_http(server, client):
    with cf.ThreadPoolExecutor(2) as pool:
        fut = pool.submit(client.generate, [1, 2, 3], {"max_new_tokens": 450, "ignore_eos": True}, rid="to-abort",
                          return_logprob=True)
        wait_running(server, 1)
        client.abort("to-abort")
        r = fut.result(T)
    assert r["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < r["meta_info"]["completion_tokens"] < 450
    assert len(r["output_ids"]) == len(r["meta_info"]["output_token_logprobs"])


def test_abort_all_and_pause_continue(server, client):
    with cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(client.generate, [i + 1], {"max_new_tokens": 450, "ignore_eos": True}) for i in range(3)]
        wait_running(server, 3)
        client.pause()  # SGLang's default mode aborts what is running
        res = [f.result(T) for f in futs]
        assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in res)
        waiting = pool.submit(client.generate, [5], {"max_new_tokens": 3, "ignore_eos": True})
        time.sleep(0.3)
        assert not waiting.done()  # new requests wait while paused
        client.resume()
        assert len(waiting.result(T)["output_ids"]) == 3


def test_release_and_resume_memory(server, client):
    client.release_memory()
    r = requests.post(server.url + "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2}},
                      timeout=T)
    assert r.status_code == 503 and "released" in r.json()["message"]
    assert not client.health_generate() and client.health()
    client.resume_memory()
    assert client.health_generate()
    assert len(client.generate([1], {"max_new_tokens": 2, "ignore_eos": True})["output_ids"]) == 2


def test_prompt_logprobs(server, ref):
    prompt = [10, 20, 30, 40, 50]
    r = gen(server, input_ids=prompt, return_logprob=True, logprob_start_len=0, top_logprobs_num=3,
            sampling_params={"max_new_tokens": 2, "temperature": 1.0, "ignore_eos": True})
    inp = r["meta_info"]["input_token_logprobs"]
    assert [x[1] for x in inp] == prompt and inp[0][0] is None
    exp = reference_logprobs(ref, prompt[:1], prompt[1:], 1.0)
    assert max_abs_diff([x[0] for x in inp[1:]], exp) <= 1e-5
    top = r["meta_info"]["output_top_logprobs"]
    assert len(top) == 2 and all(len(row) == 3 for row in top)


def test_info_endpoints(server, client, model_dir):
    assert client.health() and client.health_generate()
    for ep in ("/get_model_info", "/model_info"):
        info = requests.get(server.url + ep, timeout=T).json()
        assert info["model_path"] == model_dir and info["is_generation"] is True
    for ep in ("/get_server_info", "/server_info"):
        info = requests.get(server.url + ep, timeout=T).json()
        assert info["tp_size"] == 1 and info["random_seed"] == 0 and "internal_states" in info
    load = client.get_load()
    assert isinstance(load, list) and {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load[0])
    assert client.get_weight_version() == "default"
    client.flush_cache()
    assert client.session.post(server.url + "/begin_weight_update", json={}, timeout=T).json()["success"]
    assert client.session.post(server.url + "/end_weight_update", json={}, timeout=T).json()["success"]


def test_bad_requests_are_400(server):
    for body in (
        {"input_ids": [1], "sampling_params": {"top_k": 0}},
        {"input_ids": [1], "sampling_params": {"regex": "a+"}},
        {"input_ids": []},
        {"input_ids": [1], "text": "a"},
        {"input_ids": [1], "stream": True},
        {"input_ids": [99999]},
    ):
        r = requests.post(server.url + "/generate", json=body, timeout=T)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["message"]


def test_client_errors_name_url_and_endpoint(server, client):
    with pytest.raises(EngineRequestError) as e:
        client.generate([1], {"top_p": 5})
    assert server.url in str(e.value) and "/generate" in str(e.value) and "top_p" in str(e.value)
    dead = EngineClient("http://127.0.0.1:9", timeout_s=2)
    with pytest.raises(EngineRequestError) as e:
        dead.flush_cache()
    assert "http://127.0.0.1:9/flush_cache" in str(e.value)
    assert not dead.health(timeout_s=1)


def test_metrics_are_prometheus_text_with_sglangs_names(server):
    from relax.wire.auth import engine_api_key
    from relax.observability.metrics_client import scrape_engine_metrics

    before = scrape_engine_metrics(server.url, engine_api_key(), timeout_s=T)
    gen(server, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    after = scrape_engine_metrics(server.url, engine_api_key(), timeout_s=T)
    names = {key.split("{")[0] for key in after}
    assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput",
            "sglang:generation_tokens_total", "sglang:num_requests_total"} <= names

    def value(metrics, name):
        (v,) = [v for k, v in metrics.items() if k.split("{")[0] == name]
        return v

    assert value(after, "sglang:generation_tokens_total") - value(before, "sglang:generation_tokens_total") == 4
    assert value(after, "sglang:num_requests_total") == value(before, "sglang:num_requests_total") + 1
    assert 0.0 <= value(after, "sglang:token_usage") <= 1.0
    # /health_generate generates a token but, as in SGLang (log_metrics=False), counts in no counter: the liveness
    # watch's probes must not show up as the clients' requests
    assert requests.get(server.url + "/health_generate", timeout=T).status_code == 200
    probed = scrape_engine_metrics(server.url, engine_api_key(), timeout_s=T)
    for name in ("sglang:num_requests_total", "sglang:generation_tokens_total", "sglang:prompt_tokens_total"):
        if name in names:
            assert value(probed, name) == value(after, name), name
    assert requests.get(server.url + "/metrics", timeout=T).status_code == 401  # the run's key, like control calls


def test_metrics_reads_do_not_disturb_each_other():
    """Counters are cumulative and gen_throughput covers a span of time, so a second reader (the metrics service
    beside the autoscaler) sees what the first saw instead of "nothing since the other's read"."""
    from types import SimpleNamespace

    from relax.backends.embedded.metrics_text import EngineMetrics
    from relax.observability.metrics_client import parse_prometheus_text

    engine = SimpleNamespace(stats={"num_generated_tokens": 0}, served_model_name="m", max_running_requests=2,
                             context_length=8, num_tokens_in_use=lambda: 4, num_running=lambda: 1,
                             num_waiting=lambda: 0)
    metrics = EngineMetrics(engine)

    def read():
        samples, types = parse_prometheus_text(metrics.text())
        return {s.name: s.value for s in samples}, types

    time.sleep(0.2)
    engine.stats["num_generated_tokens"] = 100
    first, types = read()
    second, _ = read()  # another reader, right after
    assert first["sglang:generation_tokens_total"] == second["sglang:generation_tokens_total"] == 100
    assert first["sglang:gen_throughput"] > 0
    assert second["sglang:gen_throughput"] > 0.5 * first["sglang:gen_throughput"]
    assert types["sglang:generation_tokens_total"] == "counter" and types["sglang:gen_throughput"] == "gauge"
    assert types["sglang:token_usage"] == "gauge" and second["sglang:token_usage"] == 0.25


def test_group_requests_of_one_turn_go_as_one_batch_with_each_groups_seeds(server, monkeypatch):
    """relax.rollout.generate.generate_group: groups issued together go as one batched request whose prompts keep
    their own seeds (custom_labels.sampling_seeds), so each answer is what the group alone would get."""
    import asyncio

    import aiohttp

    from relax.data.sample import Sample
    from relax.rollout import generate as G

    sent = []
    post = G.post_generate

    async def counting(session, url, payload, **kw):
        sent.append(len(payload["input_ids"]) if isinstance(payload["input_ids"][0], list) else 1)
        return await post(session, url, payload, **kw)

    monkeypatch.setattr(G, "post_generate", counting)
    monkeypatch.setattr(G, "_ROLLOUT_SEED", 5)
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6}

    def groups():
        return [[Sample(index=g * 3 + j, group_index=g, prompt_tokens=[5, 6, 7 + g], rollout_step=0)
                 for j in range(3)] for g in range(4)]

    async def together():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(G.generate_group(s, server.url, g, sampling) for g in groups()))

    async def apart():
        async with aiohttp.ClientSession() as s:
            return [await G.generate_group(s, server.url, g, sampling) for g in groups()]

    batched = asyncio.run(together())
    assert sent == [4]
    sent.clear()
    alone = asyncio.run(apart())
    assert sent == [1, 1, 1, 1]
    assert [[(s.response_tokens, s.status) for s in g] for g in batched] == \
        [[(s.response_tokens, s.status) for s in g] for g in alone]
    assert batched[2][1].metadata["rid"].endswith("_2_1") and alone[2][1].metadata["rid"].endswith("_1")
