"""MATH answer checkers against a graded table (tests/fixtures/eval/math_answer_pairs.jsonl):
the default ("hybrid") gets every verdict right but one documented convention, math-verify and
the own checker miss exactly the cases docs/evaluators.md lists, and the committed results file
(benchmarks/math_verify_parity.py) is what the checkers say today."""

import hashlib
import json
from pathlib import Path

import pytest
from _reference import require

require("math_verify")

from mergelab.eval import EvalSettings  # noqa: E402
from mergelab.eval.scoring_math import MATH_CHECKERS, math_correct  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "fixtures" / "eval" / "math_answer_pairs.jsonl"
RESULTS = ROOT / "results" / "eval" / "math_verify_parity.json"

# (prediction, reference) each checker gets wrong; None = a whole fixture solution.
WRONG = {
    # MATH's answer to a percent question is the number before "%"; math-verify (and so the
    # hybrid, which only adds acceptances) also takes the fraction.
    "hybrid": {("0.5", r"50\%")},
    "math-verify": {
        ("0.5", r"50\%"),
        ("15 dollars", "15"),  # a unit written as a word
        (r"12.5\%", "12.5"),  # percentages with decimals
        (r"1.5\%", "1.5"),
    },
    "mergelab": {
        (r"9\ \text{cm}^2", r"9\text{ cm}^2"),
        (r"\{2,1\}", r"\{1,2\}"),  # sets compared in order
        (r"\{3, 2, 1\}", r"\{1,2,3\}"),
        (r"\{1, -1\}", r"\{-1,1\}"),
        ("A", r"\text{(A)}"),  # choice letters with and without the parentheses
        (r"\textbf{(C)}", "C"),
        ("(1,2)", "(1,2]"),  # half-open vs open intervals
        ("[0,1)", "[0, 1]"),
        (r"x \in [2, 5]", "[2,5]"),
        ("3, 2", "2, 3"),  # an unordered list of solutions
    },
}


def _generation(case):
    if "generation" in case:
        return case["generation"]
    return f"So the answer is $\\boxed{{{case['prediction']}}}$."


@pytest.fixture(scope="module")
def graded():
    cases = [json.loads(line) for line in CASES.read_text(encoding="utf-8").splitlines() if line]
    for case in cases:
        text = _generation(case)
        case["verdicts"] = {c: math_correct(text, case["reference"], c)[0] for c in MATH_CHECKERS}
    return cases


@pytest.mark.parametrize("checker", MATH_CHECKERS)
def test_each_checker_misses_exactly_the_documented_cases(graded, checker):
    wrong = {
        (case.get("prediction"), case["reference"])
        for case in graded
        if case["verdicts"][checker] != case["equal"]
    }
    assert wrong == WRONG[checker]


def test_every_fixture_solution_is_correct_under_every_checker(graded):
    solutions = [c for c in graded if c["category"] == "fixture solution"]
    assert len(solutions) == 5
    assert all(all(c["verdicts"].values()) for c in solutions)


def test_the_results_file_is_current(graded):
    result = json.loads(RESULTS.read_text(encoding="utf-8"))
    assert result["config"]["cases_sha256"] == hashlib.sha256(CASES.read_bytes()).hexdigest()
    assert [r["verdicts"] for r in result["rows"]] == [c["verdicts"] for c in graded]


def test_the_harness_defaults_to_the_hybrid_checker():
    assert EvalSettings().math_checker == "hybrid"
    with pytest.raises(ValueError, match="math_checker"):
        EvalSettings(math_checker="sympy")
    assert math_correct(r"so $\boxed{\{2,1\}}$", r"\{1,2\}")[0]
    assert not math_correct(r"so $\boxed{\{2,1\}}$", r"\{1,2\}", "mergelab")[0]
