"""Synthetic tasks, rewards and the format warm start of the embedded tiny default."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from relax.models.tasks import (
    DEFAULT_TASK,
    TASKS,
    exact_match_reward,
    generate_task_dataset,
    get_task,
    make_input,
    number_match_reward,
    render_prompt,
    task_reward,
    task_rows,
)

torch = pytest.importorskip("torch")


# ----------------------------------------------------------------------------- datasets


def test_dataset_is_deterministic(tmp_path):
    a = generate_task_dataset(tmp_path / "a.jsonl", 57, seed=3)
    b = generate_task_dataset(tmp_path / "b.jsonl", 57, seed=3)
    c = generate_task_dataset(tmp_path / "c.jsonl", 57, seed=4)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(rows) == 57
    assert all(set(r) == {"input", "label"} for r in rows)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_rows_have_correct_labels_and_uniform_coverage(task):
    spec = get_task(task)
    n = 3 * len(spec.prompts) + 1 if len(spec.prompts) < 200 else 150
    rows = task_rows(n, seed=0, task=task)
    counts = Counter(r["input"][0]["content"] for r in rows)
    for r in rows:
        (msg,) = r["input"]
        assert msg["role"] == "user"
        assert r["label"] == spec.answer(msg["content"])
        if spec.answer_choices:
            assert r["label"] in spec.answer_choices
    assert max(counts.values()) - min(counts.values()) <= 1  # walks shuffles of the whole space


def test_labels_follow_the_rules():
    assert get_task("successor").answer("9") == "0"
    assert get_task("successor").answer("3") == "4"
    assert get_task("copy").answer("7") == "7"
    assert get_task("add_mod10").answer("8+5=") == "3"
    assert get_task("max3").answer("382") == "8"
    word = get_task("word_arith")
    for p in word.prompts[:: max(1, len(word.prompts) // 50)]:
        nums = [int(x) for x in p.replace(".", " ").replace("?", " ").split() if x.isdigit()]
        assert int(word.answer(p)) in {nums[0] + nums[1], nums[0] - nums[1], nums[0] * nums[1]}


def test_text_format_and_rendering():
    from relax.models.tiny import build_byte_tokenizer

    tok = build_byte_tokenizer()
    rows = task_rows(5, seed=0, task="successor", prompt_format="text")
    assert all(isinstance(r["input"], str) for r in rows)
    assert render_prompt(tok, "3") == "3"
    text = render_prompt(tok, make_input("3"))
    assert text == "<|im_start|>user\n3<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- rewards


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("7", "7", 1.0),
        (" 7 \n", "7", 1.0),
        ("7<|im_end|>", "7", 1.0),
        ("7 <|im_end|>", "7", 1.0),
        ("7<|im_end|><|im_end|>", "7", 1.0),
        ("77", "7", 0.0),
        ("7.", "7", 0.0),
        ("The answer is 7", "7", 0.0),
        ("", "7", 0.0),
        ("<|im_end|>", "7", 0.0),
        ("<|im_end|>7", "7", 0.0),
        ("8<|im_end|>", "7", 0.0),
    ],
)
def test_exact_match_reward(response, label, expected):
    assert exact_match_reward(response, label) == expected


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("The answer is 7.", "7", 1.0),
        ("3 + 4 = 7", "7", 1.0),
        ("7.0", "7", 1.0),
        ("1,200 apples", "1200", 1.0),
        ("70", "7", 0.0),
        ("3 + 4 = 7, then 8", "7", 0.0),
        ("seven", "7", 0.0),
        ("-3", "-3", 1.0),
    ],
)
def test_number_match_reward(response, label, expected):
    assert number_match_reward(response, label) == expected


def test_task_reward_names():
    assert task_reward("successor") is exact_match_reward
    assert task_reward("word_arith") is number_match_reward


# ----------------------------------------------------------------------------- warm start


def _state(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory):
    from relax.models.tiny import build_tiny_model_dir
    from relax.models.warmstart import format_warm_start

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("warm") / "m"
    build_tiny_model_dir(path, seed=0)
    report = format_warm_start(path, DEFAULT_TASK, seed=0)
    return path, report


def _next_token_probs(model, tok, texts):
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        logits = model(**enc).logits
    last = enc["attention_mask"].sum(1) - 1  # right padding
    return torch.softmax(logits[torch.arange(len(texts)), last].float(), -1)


def test_warm_start_teaches_format_not_mapping(warm_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, report = warm_model
    assert report["final_loss"] < report["loss_floor"] + 0.02
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "right"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    spec = get_task(DEFAULT_TASK)
    digit_ids = tok.convert_tokens_to_ids(list(spec.answer_choices))
    eos = tok.eos_token_id

    rows = task_rows(100, seed=1, task=DEFAULT_TASK)
    texts = [render_prompt(tok, r["input"]) for r in rows]
    probs = _next_token_probs(model, tok, texts)
    digit_p = probs[:, digit_ids]
    # Format: the first answer token is a digit ...
    assert digit_p.sum(1).min() > 0.98
    # ... and it is uniform over the digits whatever the prompt: the mapping is not learned.
    assert (digit_p / digit_p.sum(1, keepdim=True) - 0.1).abs().max() < 0.02
    label_idx = torch.tensor([spec.answer_choices.index(r["label"]) for r in rows])
    expected_acc = digit_p[torch.arange(len(rows)), label_idx].mean().item()
    assert abs(expected_acc - 0.1) < 0.01
    # After any digit the answer ends.
    after = _next_token_probs(model, tok, [texts[0] + d for d in spec.answer_choices])
    assert after[:, eos].min() > 0.95

    # Sampled answers, as a rollout would draw them: in format, right at chance level.
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    with torch.no_grad():
        gen = model.generate(
            **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=4,
            num_return_sequences=4, eos_token_id=eos, pad_token_id=tok.pad_token_id,
        )
    resp = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
    in_format = [r.replace("<|pad|>", "") for r in resp]
    assert sum(len(r) == len("0<|im_end|>") and r[0].isdigit() for r in in_format) / len(resp) > 0.95
    labels = [r["label"] for r in rows for _ in range(4)]
    acc = sum(exact_match_reward(r, l) for r, l in zip(in_format, labels)) / len(resp)
    assert 0.03 <= acc <= 0.2, acc  # 400 draws at p=0.1: 0.03..0.2 is > 5 sigma wide


def test_warm_start_never_sees_labels(tmp_path):
    """`successor` and `copy` share prompts and answer choices but differ in every label:
    the warm start must produce bit-identical weights for both."""
    from relax.models.tiny import build_tiny_model_dir
    from relax.models.warmstart import format_warm_start

    torch.set_num_threads(1)
    states = []
    for task in ("successor", "copy"):
        path = build_tiny_model_dir(tmp_path / task, seed=1)
        format_warm_start(path, task, steps=3, seed=5, batch_size=4)
        states.append(_state(path))
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_warm_start_is_deterministic_and_changes_weights(tmp_path):
    from relax.models.tiny import build_tiny_model_dir
    from relax.models.warmstart import format_warm_start

    torch.set_num_threads(1)
    fresh = _state(build_tiny_model_dir(tmp_path / "fresh", seed=2))
    states = []
    for name in ("a", "b"):
        path = build_tiny_model_dir(tmp_path / name, seed=2)
        format_warm_start(path, "successor", steps=3, seed=7, batch_size=4)
        states.append(_state(path))
        assert (path / "relax_warmstart.json").exists()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert any(not torch.equal(states[0][k], fresh[k]) for k in fresh)


def test_warm_start_rejects_open_answer_tasks(tmp_path):
    from relax.models.tiny import build_tiny_model_dir
    from relax.models.warmstart import format_warm_start

    path = build_tiny_model_dir(tmp_path / "m", seed=0)
    with pytest.raises(ValueError):
        format_warm_start(path, "word_arith", steps=1)
