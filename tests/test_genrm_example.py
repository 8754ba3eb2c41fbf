"""The GenRM example's pieces without a model: its yes/no judge hooks through GenRMJudge's request path and the
agreement figures of examples/genrm/measure_judge.py."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "genrm"


def _load(name):
    sys.path.insert(0, str(EXAMPLE))
    try:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLE))


@pytest.mark.parametrize("text,score", [("Yes", 1.0), ("No.", 0.0), ("yes, it is correct", 1.0),
                                        ("The answer is wrong. No", 0.0), ("Nope", None), ("", None),
                                        ("None of them; yes", 1.0)])
def test_yes_no_parser(text, score):
    assert _load("judge_hooks").yes_no_parser(text) == score


def test_yes_no_template_holds_problem_answer_and_response():
    hooks = _load("judge_hooks")
    (message,) = hooks.yes_no_template([{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "Sam has 5 bags of 2 books."}], " 10 \n", "10")
    assert message["role"] == "user"
    text = message["content"]
    assert "Problem: Sam has 5 bags of 2 books." in text and "be brief" not in text
    assert "The correct answer is 10." in text and "Student's answer: 10\n" in text and text.endswith("Yes or No.")
    assert "correct answer" not in hooks.yes_no_template("2+2=", "4")[0]["content"]


def test_agreement_figures():
    agreement = _load("measure_judge").agreement
    figures = agreement([1.0, 1.0, 0.0, 0.0, 0.8, 0.2], [1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    assert (figures["both_correct"], figures["both_wrong"], figures["judge_says_correct_exact_wrong"],
            figures["judge_says_wrong_exact_correct"]) == (2, 2, 1, 1)
    assert figures["agreement"] == pytest.approx(4 / 6, abs=1e-4)  # figures are rounded to 4 places
    # chance agreement with both positive rates 1/2 is 1/2: kappa = (2/3 - 1/2) / (1/2)
    assert figures["cohen_kappa"] == pytest.approx(1 / 3, abs=1e-4)
    constant = agreement([0.0, 0.0, 0.0], [0.0, 0.0, 1.0])  # a judge that always says "wrong": no skill
    assert constant["agreement"] == pytest.approx(2 / 3, abs=1e-4) and constant["cohen_kappa"] == pytest.approx(0.0)
    assert math.isnan(agreement([1.0], [1.0])["cohen_kappa"]) and agreement([], [])["parsed"] == 0
