"""--multimodal-keys: the mapped fields of the data rows land on the samples (rollout and evaluation) and
in the /generate request body as SGLang's image_data/video_data/audio_data; the text-only embedded
engine is refused at parse time (also when `auto` resolves to it), and a real embedded
engine that receives such a request rejects it by name (so nothing is dropped silently)."""

import asyncio
import json

import pytest

from conftest import shared_tiny_model

from relax.config import parse_config
from relax.config.errors import ConfigError
from relax.rollout.buffer import build_data_source

IMAGES = [["a.png", "b.png"], None, "data:image/png;base64,AAAA"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("mm")
    model = shared_tiny_model()
    data = base / "train.jsonl"
    rows = []
    for i, img in enumerate(IMAGES):
        row = {"input": f"describe {i}", "label": str(i), "extra": {"vid": f"v{i}.mp4"}}
        if img is not None:
            row["pics"] = img
        rows.append(row)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return base, str(model), str(data)


def config(assets, *extra, backend="sglang"):
    base, model, data = assets
    return parse_config(["--hf-checkpoint", model, "--prompt-data", data, "--label-key", "label",
                         "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--num-rollout", "1",
                         "--rollout-backend", backend, "--output-dir", str(base / "out"), *extra])


MM = '{"image": "pics", "video": "extra.vid"}'


def test_fields_land_on_the_samples_and_in_the_request(assets):
    from relax.rollout.generate import generate_payload, sample_payload_fields

    cfg = config(assets, "--multimodal-keys", MM)
    assert cfg.multimodal_keys == {"image": "pics", "video": "extra.vid"}
    source = build_data_source(cfg)
    groups = source.get_samples(3)
    for i, g in enumerate(groups):
        assert len(g) == 2
        for s in g:
            mm = s.metadata["multimodal_inputs"]
            want = {"video": f"v{i}.mp4"} if IMAGES[i] is None else {"image": IMAGES[i], "video": f"v{i}.mp4"}
            assert mm == want
            body = generate_payload(s.prompt_tokens, {"max_new_tokens": 4}, rid="r", extra=sample_payload_fields(s))
            assert body["input_ids"] == s.prompt_tokens and body["rid"] == "r" and body["return_logprob"] is True
            assert body["video_data"] == f"v{i}.mp4"
            assert body.get("image_data") == IMAGES[i]
            assert "image" not in body and "multimodal_inputs" not in body
    # a checkpointed buffer keeps them
    source.add_samples(groups[:1])
    fresh = build_data_source(cfg)
    fresh.load_state_dict(json.loads(json.dumps(source.state_dict())))
    assert fresh.get_samples(1)[0][0].metadata["multimodal_inputs"]["image"] == IMAGES[0]
    # without the flag: text only
    plain = build_data_source(config(assets)).get_samples(1)[0][0]
    assert "multimodal_inputs" not in plain.metadata and sample_payload_fields(plain) == {}


def test_eval_samples_carry_them_too(assets):
    from relax.rollout.evaluation import _records

    base, model, data = assets
    recs = _records(type("S", (), {"path": data, "input_key": "input", "label_key": "label", "metadata_key": None,
                                   "tool_key": None})(), config(assets, "--multimodal-keys", MM))
    assert [r.multimodal for r in recs][0] == {"image": IMAGES[0], "video": "v0.mp4"}


def test_flag_rules(assets):
    with pytest.raises(ConfigError, match="--multimodal-keys.*embedded engine is text-only"):
        config(assets, "--multimodal-keys", MM, backend="embedded")
    with pytest.raises(ConfigError, match="unknown modality 'picture'"):
        config(assets, "--multimodal-keys", '{"picture": "pics"}')
    with pytest.raises(ConfigError, match="non-empty string"):
        config(assets, "--multimodal-keys", '{"image": 3}')
    # an external engine may be SGLang: allowed at parse time
    assert config(assets, "--multimodal-keys", MM, "--rollout-external", "--rollout-external-engine-addrs",
                  "127.0.0.1:1", backend="embedded").multimodal_keys


def test_auto_backend_resolving_to_embedded_stops_at_parse_time(assets):
    from relax.config.sglang import resolve_backend

    if resolve_backend("auto") != "embedded":
        pytest.skip("auto resolves to SGLang here")
    with pytest.raises(ConfigError, match="--multimodal-keys"):  # the CLI stops before Ray starts
        config(assets, "--multimodal-keys", MM, backend="auto")
    assert config(assets, backend="auto").rollout_backend == "embedded"  # resolved once; every role reads it


def test_a_real_embedded_engine_rejects_the_images_by_name(assets):
    import aiohttp

    from relax.backends.embedded.launcher import EmbeddedServerProcess
    from relax.rollout.generate import GenerationError, generate_one

    base, model, data = assets
    cfg = config(assets, "--multimodal-keys", MM)
    mm, plain = build_data_source(cfg).get_samples(2)
    proc = EmbeddedServerProcess(model, server_args={"random_seed": 0, "dtype": "float32"})
    proc.start()
    try:
        proc.wait_healthy(120)

        async def go(sample):
            async with aiohttp.ClientSession() as session:
                return await generate_one(session, proc.url, sample, {"max_new_tokens": 2}, retries=0)

        with pytest.raises(GenerationError, match="image_data is not supported"):
            asyncio.run(go(mm[0]))
        plain[0].metadata.pop("multimodal_inputs")  # the same sample without images generates
        assert asyncio.run(go(plain[0])).response_tokens
    finally:
        proc.stop()
