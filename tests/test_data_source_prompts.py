"""prompts.py (chat template, system prompt, max_prompt_len) and filtering in PromptDataSource."""

import json

import pytest

from relax.models.tiny import build_byte_tokenizer
from relax.rollout.data_source import PromptDataSource, PromptRecord
from relax.rollout.prompts import PromptEncoder, encode_prompt, render_prompt


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def test_chat_template_with_system_prompt(tok):
    text = render_prompt("hi", tok, system_prompt="be brief")
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt("hi", tok) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # an existing system message is kept, not duplicated
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    assert render_prompt(msgs, tok, system_prompt="other").count("system") == 1
    # kwargs reach the template
    assert not render_prompt("hi", tok, chat_template_kwargs={"add_generation_prompt": False}).endswith("assistant\n")


def test_plain_prompt_without_template(tok):
    assert render_prompt("hi", None, apply_chat_template=False) == "hi"
    assert render_prompt("hi", None, apply_chat_template=False, system_prompt="sys") == "sys\nhi"
    assert render_prompt("hi", None, apply_chat_template=False, system_prompt="sys", system_separator="") == "syshi"
    with pytest.raises(TypeError, match="needs the chat template"):
        render_prompt([{"role": "user", "content": "u"}], tok, apply_chat_template=False)


def test_encode_roundtrip_and_record_input(tok):
    rec = PromptRecord(0, "what is 2+2?", "4", {}, None)
    ids = encode_prompt(rec, tok, system_prompt="s")
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == render_prompt("what is 2+2?", tok, system_prompt="s")
    assert encode_prompt("abc", tok, apply_chat_template=False) == tok.encode("abc", add_special_tokens=False)


def test_prompt_encoder_filters_and_counts(tok):
    enc = PromptEncoder(tok, max_prompt_len=40)
    short, long = "hi", "x" * 100
    assert enc.fits(short) and not enc.fits(long)
    assert enc.encode_or_none(short) is not None
    assert enc.encode_or_none(long) is None
    assert enc.filter_records([PromptRecord(0, short), PromptRecord(1, long), PromptRecord(2, short)]) == [
        PromptRecord(0, short), PromptRecord(2, short)
    ]
    assert enc.stats() == {"encoded_prompts": 3, "filtered_long_prompts": 2}
    with pytest.raises(ValueError):
        PromptEncoder(tok, max_prompt_len=0)


@pytest.mark.parametrize("streaming", [False, True])
def test_data_source_max_prompt_len_filtering(tmp_path, tok, streaming):
    path = tmp_path / "p.jsonl"
    prompts = ["short", "y" * 200, "tiny", "z" * 300, "ok"]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    enc = PromptEncoder(tok, max_prompt_len=50)
    src = PromptDataSource(str(path), prompt_encoder=enc, streaming=streaming, buffer_size=2)
    batch = src.get_batch(6)  # wraps into the next epoch
    assert [r.prompt for r in batch] == ["short", "tiny", "ok", "short", "tiny", "ok"]
    assert [r.index for r in batch[:3]] == [0, 2, 4]  # indices are file positions of good rows
    assert src.stats()["filtered_long_prompts"] == 2  # counted once, not once per epoch
    assert src.num_prompts == 3
    # resuming does not recount
    state = src.state_dict()
    again = PromptDataSource(str(path), prompt_encoder=enc, streaming=streaming, buffer_size=2)
    again.load_state_dict(state)
    again.get_batch(4)
    assert again.stats()["filtered_long_prompts"] == 2


def test_from_args(tmp_path, tok):
    from types import SimpleNamespace

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"input": f"q{i}", "ans": str(i)}) + "\n" for i in range(5)) + json.dumps({"input": "w" * 400}) + "\n")
    args = SimpleNamespace(
        prompt_data=str(path), input_key="input", label_key="ans", metadata_key="metadata", tool_key="tools",
        rollout_shuffle=True, rollout_seed=5, use_streaming_dataset=False, streaming_buffer_size=10000,
        apply_chat_template=True, apply_chat_template_kwargs={}, system_prompt="S", rollout_max_prompt_len=64,
        skip_bad_lines=False, multimodal_keys=None,
    )
    enc = PromptEncoder.from_args(args, tok)
    src = PromptDataSource.from_args(args, prompt_encoder=enc)
    assert src.num_prompts == 5 and src.stats()["filtered_long_prompts"] == 1
    batch = src.get_batch(5)
    assert sorted(r.label for r in batch) == ["0", "1", "2", "3", "4"]
    assert enc.render(batch[0]).startswith("<|im_start|>system\nS<|im_end|>")
