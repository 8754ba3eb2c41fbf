"""Math answer extraction/equivalence and the math-family rewards."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.rollout.rewards import get_reward_fn
from relax.rollout.rewards.math_grader import (
    extract_answer_is,
    extract_boxed,
    extract_math_answer,
    is_equiv,
    last_boxed_only_string,
    normalize_answer,
    sympy_available,
)

EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{1}{2}", "1/2"),
    ("\\tfrac12", "0.5"),
    ("\\frac12", "\\frac{1}{2}"),
    ("1/2", "0.50"),
    (".5", "0.5"),
    ("50\\%", "50"),
    ("50\\%", "0.5"),
    ("50%", "50"),
    ("x=3", "3"),
    ("x = 3", "3"),
    ("3", "y=3"),
    ("\\text{(A)}", "A"),
    ("\\boxed{\\text{(A)}}", "(A)"),
    ("(B)", "B"),
    ("-3", "-3.0"),
    ("-\\frac{1}{2}", "-0.5"),
    ("\\frac{-1}{2}", "-\\frac12"),
    ("1,000", "1000"),
    ("1{,}000", "1000"),
    ("1\\,000", "1000"),
    ("\\$1,000", "1000"),
    ("1,000,000", "10^6"),
    ("[1,2)", "[1, 2)"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("(-\\infty, 3) \\cup (4, \\infty)", "(4,\\infty)\\cup(-\\infty,3)"),
    ("\\{1,2\\}", "\\{2, 1\\}"),
    ("1, 2", "2, 1"),
    ("x=2, y=3", "(2,3)"),
    ("x \\in [1,2]", "[1,2]"),
    ("10\\text{ cm}", "10"),
    ("5 cm", "5"),
    ("12 square feet", "12"),
    ("90^\\circ", "90"),
    ("90^{\\circ}", "90"),
    ("\\$5", "5"),
    ("$\\frac{3}{4}$", "0.75"),
    ("2\\frac{1}{2}", "2.5"),
    ("1e3", "1000"),
    ("0.333333", "\\frac{1}{3}"),
    ("0.6666667", "2/3"),
    ("\\text{Yes}", "yes"),
]

SYMPY_EQUIVALENT = [
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\sqrt2", "\\sqrt{2}"),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}"),
    ("2x+1", "1+2x"),
    ("x^2+2x+1", "(x+1)^2"),
    ("\\pi/2", "\\frac{\\pi}{2}"),
    ("y=2x+1", "y=1+2x"),
    ("3+4i", "4i+3"),
    ("10^{3}", "1000"),
    ("\\sqrt[3]{8}", "2"),
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
    ("2\\cdot 3", "6"),
    ("10^6", "1000000"),
    ("3.14159", "\\pi"),
    ("1.414214", "\\sqrt{2}"),
]

NOT_EQUIVALENT = [
    ("\\frac{1}{3}", "0.333"),
    ("(1,2)", "(2,1)"),
    ("[1,2)", "[1,2]"),
    ("(1,2)", "(1,2,3)"),
    ("3", "-3"),
    ("x+1", "x-1"),
    ("A", "B"),
    ("1,000", "1001"),
    ("2", "\\text{(B)}"),
    ("5", "50\\%"),
    ("", "0"),
    ("\\sqrt{2}", "1.414"),
    ("x^2", "2x"),
    ("999999", "1000000"),
    ("10^6", "999999"),
    ("3.14", "\\pi"),
    ("0.33", "\\frac{1}{3}"),
]


@pytest.mark.parametrize("pred,gold", EQUIVALENT)
def test_equivalent(pred, gold):
    assert is_equiv(pred, gold), (normalize_answer(pred), normalize_answer(gold))
    assert is_equiv(gold, pred)


@pytest.mark.skipif(not sympy_available(), reason="sympy not installed")
@pytest.mark.parametrize("pred,gold", SYMPY_EQUIVALENT)
def test_equivalent_symbolic(pred, gold):
    assert is_equiv(pred, gold)
    assert is_equiv(gold, pred)


def test_sympy_is_imported_at_the_first_answer_that_needs_it():
    """A rollout process imports the grader at start-up; sympy comes only with the first symbolic answer, also when
    several threads grade at once (batched rewards)."""
    import subprocess
    import sys

    code = """
import sys, threading
from relax.rollout.rewards.math_grader import is_equiv
assert "sympy" not in sys.modules, "imported with the grader"
assert is_equiv("0.5", "1/2") and "sympy" not in sys.modules, "imported for numbers"
results = []
threads = [threading.Thread(target=lambda: results.append(is_equiv("\\\\sqrt{4}", "2"))) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert results == [True] * 8 and "sympy" in sys.modules, results
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("pred,gold", NOT_EQUIVALENT)
def test_not_equivalent(pred, gold):
    assert not is_equiv(pred, gold)


def test_none_never_equivalent():
    assert not is_equiv(None, "1")
    assert not is_equiv("1", None)


@pytest.mark.parametrize(
    "hostile",
    ["9^{9^{9^{9}}}", "2^{2^{2^{2^{2^{10}}}}}", "(2^{999})^{999}+x", "(2^{1000})^{1000}", "__import__('os').system('true')", "().__class__", "lambda: 1",
     "x" * 5000, "\\frac{" * 200 + "1" + "}{2}" * 200],
)
def test_hostile_input_is_rejected_quickly(hostile):
    t0 = time.perf_counter()
    assert not is_equiv(hostile, "1")
    assert time.perf_counter() - t0 < 2.0


def test_last_boxed_nested_braces():
    text = "first \\boxed{1} then \\boxed{\\frac{1}{\\sqrt{2}}}."
    assert extract_boxed(text) == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed_only_string(text) == "\\boxed{\\frac{1}{\\sqrt{2}}}"
    assert extract_boxed("\\boxed{{a}{b}}") == "{a}{b}"
    assert extract_boxed("so \\boxed 5$ done") == "5"
    assert extract_boxed("\\fbox{7}") == "7"
    assert extract_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert extract_boxed("\\boxed{unbalanced") is None
    assert extract_boxed("no box") is None
    assert extract_boxed("") is None


def test_answer_is_and_fallback_extraction():
    assert extract_answer_is("Thus the answer is 3.5.") == "3.5"
    assert extract_answer_is("The final answer is: $\\frac12$. Done") == "$\\frac12$"
    assert extract_answer_is("Answer: 42\nmore text") == "42"
    assert extract_answer_is("the answer is \\boxed{7}.") == "7"
    assert extract_math_answer("I get 3 then 1,000 apples") == "1,000"
    assert extract_math_answer("it was -4 or -7") == "-7"
    assert extract_math_answer("\\boxed{2} ... the answer is 3") == "2"
    assert extract_math_answer("nothing") is None


MATH = get_reward_fn("math")


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("So the result is \\boxed{\\dfrac{1}{2}}.", "0.5", 1.0),
        ("So the result is \\boxed{\\dfrac{1}{2}}.", "0.6", 0.0),
        ("The answer is 1,000.", "1000", 1.0),
        ("We find x = 3, the answer is $x=3$", "3", 1.0),
        ("Therefore 2 + 2 = 4", "4", 1.0),
        ("\\boxed{-5}", "-5", 1.0),
        ("\\boxed{5}", "-5", 0.0),
        ("\\boxed{\\text{(C)}}", "C", 1.0),
        ("\\boxed{[2, 5)}", "[2,5)", 1.0),
        ("<think>maybe \\boxed{1}</think> final: \\boxed{2}", "2", 1.0),
        ("<think>\\boxed{2}</think> final: \\boxed{1}", "2", 0.0),
        ("no answer here", "2", 0.0),
        ("\\boxed{3}", ["2", "3"], 1.0),
        ("\\boxed{3}", 3, 1.0),
        ("\\boxed{0.5}", 0.5, 1.0),
        ("\\boxed{3}", "\\boxed{3}", 1.0),
    ],
)
def test_math_reward(response, label, expected):
    assert MATH(response, label, {}) == expected


DAPO = get_reward_fn("dapo")


def test_dapo_reward():
    assert DAPO("reasoning...\nAnswer: 42", "42", {}) == 1.0
    assert DAPO("reasoning...\nanswer: \\frac{1}{2}", "0.5", {}) == 1.0
    assert DAPO("Answer: 1\nwait\nAnswer: 2", "2", {}) == 1.0
    assert DAPO("reasoning...\nAnswer: 41", "42", {}) == -1.0
    assert DAPO("\\boxed{42}", "42", {}) == -1.0  # DAPO requires the "Answer:" format
    assert DAPO("Answer: \\boxed{42}", "42", {}) == 1.0
    # only the tail is searched
    long = "Answer: 42\n" + "x" * 400
    assert DAPO(long, "42", {}) == -1.0
    assert DAPO(long, "42", {"dapo_tail_chars": 0}) == 1.0


DEEPSCALER = get_reward_fn("deepscaler")


def test_deepscaler_reward():
    assert DEEPSCALER("<think>work</think>The answer is \\boxed{\\frac{1}{2}}", "0.5", {}) == 1.0
    assert DEEPSCALER("<think>\\boxed{7}</think>so \\boxed{8}", "7", {}) == 0.0
    assert DEEPSCALER("<think>still thinking \\boxed{7}", "7", {}) == 0.0  # truncated reasoning
    assert DEEPSCALER("no think, \\boxed{7}", "7", {}) == 1.0
    assert DEEPSCALER("</think>the answer is 7", "7", {}) == 0.0  # needs a boxed answer
    assert DEEPSCALER("</think>\\boxed{7}", ["6", "\\boxed{7}"], {}) == 1.0


@settings(max_examples=60, deadline=None)
@given(st.integers(-10**6, 10**6), st.integers(1, 1000))
def test_property_fraction_forms_agree(a, b):
    assert is_equiv(f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}")
    assert is_equiv(f"\\dfrac{{{a}}}{{{b}}}", repr(a / b))  # float repr: exact, or >= 6 digits
    assert is_equiv(f"{a:,}", str(a))
    assert not is_equiv(str(a), str(a + 1))
