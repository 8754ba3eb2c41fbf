"""exact_match, f1, multiple choice / gpqa, random, boxed_ prefix, registry and rm_type resolution."""

import pytest

from relax.rollout.rewards import (
    available_reward_types,
    get_reward_fn,
    register_reward,
    resolve_rm_type,
)
from relax.rollout.rewards.builtin import extract_choice_letter


def test_registry_lists_builtins_and_rejects_unknown():
    types = set(available_reward_types())
    assert {"exact_match", "math", "dapo", "deepscaler", "f1", "gpqa", "multiple_choice", "random", "remote_rm"} <= types
    with pytest.raises(ValueError, match="unknown reward type 'nope'.*exact_match"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="unknown reward type 'nope'"):
        get_reward_fn("boxed_nope")
    with pytest.raises(ValueError):
        get_reward_fn("")


def test_register_reward_decorator_and_reserved_prefix():
    @register_reward("test_len_reward", overwrite=True)
    def _len_reward(response, label, metadata):
        return float(len(response))

    assert get_reward_fn("test_len_reward")("abc", None, {}) == 3.0
    assert get_reward_fn("boxed_test_len_reward")("x \\boxed{ab} y", None, {}) == 2.0
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_len_reward", _len_reward)
    with pytest.raises(ValueError, match="reserved"):
        register_reward("boxed_x", _len_reward)


def test_resolve_rm_type():
    assert resolve_rm_type("math", {}) == "math"
    assert resolve_rm_type("math", None) == "math"
    assert resolve_rm_type("math", {"rm_type": "f1"}) == "f1"
    assert resolve_rm_type(None, {"rm_type": "f1"}) == "f1"
    with pytest.raises(ValueError, match="no reward type"):
        resolve_rm_type(None, {})


def test_exact_match():
    em = get_reward_fn("exact_match")
    assert em("  42\n", "42", {}) == 1.0
    assert em("42", " 42 ", {}) == 1.0
    assert em("43", "42", {}) == 0.0
    assert em("b", ["a", "b"], {}) == 1.0
    assert em("42", 42, {}) == 1.0
    assert em("", None, {}) == 0.0


def test_boxed_prefix_extracts_last_nested_box():
    fn = get_reward_fn("boxed_exact_match")
    assert fn("first \\boxed{1}, finally \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", {}) == 1.0
    assert fn("\\boxed{{a}b}", "{a}b", {}) == 1.0
    assert fn("no box 1", "1", {}) == 0.0
    assert get_reward_fn("boxed_f1")("blah \\boxed{Paris France}", "Paris", {}) == pytest.approx(2 / 3)
    assert get_reward_fn("boxed_math")("\\boxed{0.5}", "\\frac12", {}) == 1.0


def test_f1():
    f1 = get_reward_fn("f1")
    assert f1("The cat sat.", "the cat sat", {}) == 1.0
    assert f1("the cat sat", "a cat sat down", {}) == pytest.approx(0.8)
    assert f1("dog", "cat", {}) == 0.0
    assert f1("", "cat", {}) == 0.0
    assert f1("Paris", ["London", "paris"], {}) == 1.0
    assert f1("<think>london?</think>Answer: Paris", "Paris", {}) == 1.0


@pytest.mark.parametrize(
    "response,letter",
    [
        ("The answer is (C).", "C"),
        ("Answer: B", "B"),
        ("**Answer:** D", "D"),
        ("\\boxed{A}", "A"),
        ("\\boxed{\\text{(B)}}", "B"),
        ("I think it's (A) not (C)", "C"),
        ("B", "B"),
        ("(d)", "D"),
        ("<think>maybe A</think> final answer: C", "C"),
        ("nothing here", None),
    ],
)
def test_extract_choice_letter(response, letter):
    assert extract_choice_letter(response, "ABCD") == letter


def test_gpqa_and_multiple_choice():
    gpqa = get_reward_fn("gpqa")
    assert gpqa("The answer is (C).", "C", {}) == 1.0
    assert gpqa("The answer is (C).", "(C)", {}) == 1.0
    assert gpqa("The answer is (C).", "B", {}) == 0.0
    assert gpqa("The answer is (E).", "E", {}) == 0.0  # GPQA has A-D only
    assert gpqa("Answer: B", None, {"correct_letter": "B"}) == 1.0
    mc = get_reward_fn("multiple_choice")
    md = {"choices": ["red", "green", "blue", "cyan", "magenta"]}
    assert mc("Answer: E", "magenta", md) == 1.0  # label as choice text, 5 choices -> A-E
    assert mc("Answer: E", "E", md) == 1.0
    assert mc("\\boxed{blue}", "C", md) == 1.0  # response names the choice text
    assert mc("Answer: A", "blue", md) == 0.0
    assert mc("Answer: B", 1, {}) == 1.0  # integer label = option index
    assert mc("Answer: F", "F", {"valid_letters": "ABCDEF"}) == 1.0
    assert mc("whatever", "Z", {}) == 0.0


def test_random_is_seeded_and_binary():
    rnd = get_reward_fn("random")
    values = [rnd(f"resp {i}", "x", {"seed": 7}) for i in range(200)]
    assert set(values) == {0.0, 1.0}
    assert values == [rnd(f"resp {i}", "x", {"seed": 7}) for i in range(200)]
    assert values != [rnd(f"resp {i}", "x", {"seed": 8}) for i in range(200)]
    assert 60 < sum(values) < 140
