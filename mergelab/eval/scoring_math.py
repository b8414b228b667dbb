"""Answer extraction and comparison for GSM8K and MATH.

GSM8K (as lm-evaluation-harness scores it):
  * ``strict``: the number after ``#### `` in the model's answer;
  * ``flexible``: the last number anywhere in the generation;
  and numbers compare by value (``$1,000.00`` equals ``1000``).

MATH (Hendrycks et al., 2021), three checkers (``MATH_CHECKERS``; docs/evaluators.md has the
parity table that chose the default):

* ``"hybrid"`` (default) — math-verify's verdict (the checker most harnesses use now: the model's
  whole generation against ``\\boxed{reference}``); where it says no, the answers still count as
  equal when MATH's string normalisation below makes them identical. That rescues what the parity
  table shows math-verify missing (units written as words, decimal percentages) and nothing else.
* ``"math-verify"`` — math-verify alone (math-verify is one of mergelab's dependencies).
* ``"mergelab"`` — the own checker alone: the answer is the last ``\\boxed{...}`` (or
  ``\\fbox{...}``), braces matched; both sides are normalised (``\\dfrac``→``\\frac``,
  ``\\left``/``\\right``, units in ``\\text{}``, degrees, spaces, ``\\!``, trailing ``.0``,
  ...) and compared as strings; when they differ and both parse as expressions, they are compared
  symbolically with sympy (through a small LaTeX-to-sympy converter). It orders sets and gets
  half-open intervals wrong, which is why it is no longer the default.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

# ---------------------------------------------------------------- GSM8K

# lm-evaluation-harness gsm8k regexes: strict "#### n" (gsm8k) or "The answer is n." (the
# chain-of-thought exemplars' own marker, gsm8k-cot); flexible = last number-like token.
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)|The answer is \$?(\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def extract_gsm8k_strict(text: str) -> str | None:
    """The number after the first ``#### `` or ``The answer is `` (None when absent)."""
    m = _STRICT.search(text)
    if not m:
        return None
    return (m.group(1) or m.group(2)).rstrip(".")


def extract_gsm8k_flexible(text: str) -> str | None:
    """The last number in ``text`` (None when there is none)."""
    matches = _FLEXIBLE.findall(text)
    for a, b in reversed(matches):
        token = a or b
        if any(ch.isdigit() for ch in token):
            # lm-eval ignores "$" and a sentence-final "." when comparing; drop them here.
            return token.replace("$", "").rstrip(".,")
    return None


def extract_gsm8k(text: str, mode: str = "flexible") -> str | None:
    if mode == "strict":
        return extract_gsm8k_strict(text)
    if mode == "flexible":
        return extract_gsm8k_flexible(text)
    raise ValueError(f"GSM8K extraction mode must be 'strict' or 'flexible', got {mode!r}")


def parse_number(text: str | None) -> Fraction | None:
    """``'$1,234.50'`` → Fraction(2469, 2); ``'-7.'`` → -7; None when not a number."""
    if text is None:
        return None
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "")
    s = s.rstrip(".")
    if s.endswith("%"):
        s = s[:-1]
    if not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)", s):
        return None
    return Fraction(s)


def numbers_equal(pred: str | None, ref: str | None) -> bool:
    """Exact comparison by value (GSM8K answers are integers or short decimals)."""
    a, b = parse_number(pred), parse_number(ref)
    return a is not None and b is not None and a == b


def gsm8k_correct(
    generation: str, reference: str, mode: str = "flexible"
) -> tuple[bool, str | None]:
    """(correct, extracted answer) for one GSM8K generation."""
    pred = extract_gsm8k(generation, mode)
    return numbers_equal(pred, reference), pred


# ---------------------------------------------------------------- MATH: extraction


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces matched), or of
    ``\\boxed x`` (no braces); None when there is no complete box."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx:]
    rest = rest[len("\\boxed") :] if rest.startswith("\\boxed") else rest[len("\\fbox") :]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):
        # "\boxed 5" form: up to the next "$" or whitespace.
        return rest.strip().split("$")[0].split()[0] if rest.strip() else None
    rest = rest.lstrip()
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced: the generation was cut off inside the box


def extract_math_answer(text: str) -> str | None:
    """The model's final answer: last boxed content; else the text after "answer is"."""
    boxed = last_boxed_content(text)
    if boxed is not None:
        return boxed
    m = re.search(r"answer is[:\s]*\$?([^\n$]+?)\$?\s*\.?\s*$", text.strip(), flags=re.I)
    return m.group(1).strip() if m else None


# ---------------------------------------------------------------- MATH: normalisation

_UNIT_WORDS = (
    "units?|cm|centimeters?|meters?|m|km|kilometers?|inches|inch|in|feet|foot|ft|"
    "miles?|mph|hours?|minutes?|seconds?|sec|days?|weeks?|years?|degrees?|dollars?|cents?|"
    "square|sq|cubic|pounds?|lbs?|ounces?|oz|grams?|g|kg|liters?|gallons?|people|students?|"
    "ways?|points?|times"
)
_TRAILING_TEXT_UNITS = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{\s*[^{}]*\}\s*(\^\{?\d\}?)?$")
_TRAILING_PLAIN_UNITS = re.compile(rf"(?<=[\d}}])\s*(?:{_UNIT_WORDS})(\s*\^?\{{?\d\}}?)?$")


def _braced(s: str, start: int) -> tuple[str, int] | None:
    """(content, index after) of the brace group opening at ``s[start] == '{'``."""
    if start >= len(s) or s[start] != "{":
        return None
    depth = 0
    for i in range(start, len(s)):
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            depth -= 1
            if depth == 0:
                return s[start + 1 : i], i + 1
    return None


def _fix_fracs(s: str) -> str:
    r"""``\frac12`` → ``\frac{1}{2}``, ``\frac1{72}`` → ``\frac{1}{72}``."""
    out, i = [], 0
    while True:
        j = s.find("\\frac", i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i : j + 5])
        k = j + 5
        for _ in range(2):
            if k < len(s) and s[k] == "{":
                grp = _braced(s, k)
                if grp is None:
                    out.append(s[k:])
                    return "".join(out)
                out.append("{" + grp[0] + "}")
                k = grp[1]
            elif k < len(s) and (s[k].isalnum()):
                out.append("{" + s[k] + "}")
                k += 1
        i = k


def _fix_sqrt(s: str) -> str:
    r"""``\sqrt3`` → ``\sqrt{3}``."""
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def normalize_math_answer(answer: str | None) -> str | None:
    """Canonical string form of a MATH answer (Hendrycks's ``strip_string``, extended)."""
    if answer is None:
        return None
    s = str(answer).strip()
    s = s.replace("\n", "").replace("\\!", "").replace("\\,", "").replace("\\;", "")
    s = s.replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\displaystyle", "")
    # Degrees and percent.
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("°", "")
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace("\\$", "").replace("$", "")
    # Units written as \text{ cm} / \mbox{inches} or plain words after a number.
    for _ in range(2):
        for pattern in (_TRAILING_TEXT_UNITS, _TRAILING_PLAIN_UNITS):
            stripped = pattern.sub("", s).strip()
            s = stripped or s  # an answer that is only text (\text{(A)}) is kept
    # Unwrap remaining \text{...} (e.g. answers that are words: \text{(A)}).
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r"\1", s)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    # "x = 5" / "k=5" → "5" when the left side is a single variable.
    parts = s.split("=")
    if len(parts) == 2 and len(parts[0].strip()) <= 2:
        s = parts[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    # 5/7 → \frac{5}{7} for plain integer ratios.
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    # Numbers: drop thousands separators and trailing ".0"/".00".
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = re.sub(r"^(-?\d+)\.0+$", r"\1", s)
    s = s.rstrip(".")
    return s


# ---------------------------------------------------------------- MATH: symbolic equivalence

_ALLOWED_NAMES = {"sqrt", "pi", "oo", "log", "sin", "cos", "tan", "exp", "I", "E"}


def _replace_command(s: str, name: str, fn) -> str:
    """Replace ``\\name{a}{b}...`` (``fn`` gets the groups) innermost-first."""
    while True:
        j = s.find("\\" + name)
        if j < 0:
            return s
        k = j + len(name) + 1
        groups = []
        nargs = 2 if name == "frac" else 1
        opt = None
        if name == "sqrt" and k < len(s) and s[k] == "[":
            close = s.find("]", k)
            if close < 0:
                return s
            opt, k = s[k + 1 : close], close + 1
        for _ in range(nargs):
            grp = _braced(s, k)
            if grp is None:
                raise ValueError(f"cannot parse \\{name} arguments")
            groups.append(grp[0])
            k = grp[1]
        s = s[:j] + fn(*groups, opt=opt) + s[k:]


def latex_to_sympy(expr: str):
    """A sympy expression for a (normalised) LaTeX answer, or None if it does not parse.

    Only arithmetic, powers, fractions, roots, pi/infinity, a few functions and one-letter
    variables are accepted: the text comes from a model, and sympy's parser evaluates Python,
    so anything else is refused before parsing.
    """
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    if expr is None or len(expr) > 200:
        return None
    s = expr
    try:
        s = _replace_command(s, "frac", lambda a, b, opt=None: f"(({a})/({b}))")
        s = _replace_command(
            s, "sqrt", lambda a, opt=None: f"(({a})**(1/({opt})))" if opt else f"sqrt({a})"
        )
    except ValueError:
        return None
    for latex, py in (
        ("\\pi", " pi "),
        ("\\infty", " oo "),
        ("\\cdot", "*"),
        ("\\times", "*"),
        ("\\div", "/"),
        ("\\ln", " log "),
        ("\\log", " log "),
        ("\\sin", " sin "),
        ("\\cos", " cos "),
        ("\\tan", " tan "),
        ("\\exp", " exp "),
        ("{", "("),
        ("}", ")"),
    ):
        s = s.replace(latex, py)
    if "\\" in s or "__" in s or re.search(r"[^0-9A-Za-z+\-*/^(). ]", s):
        return None
    for name in re.findall(r"[A-Za-z]+", s):
        if len(name) > 1 and name not in _ALLOWED_NAMES:
            return None
    # Refuse towers and huge exponents, which sympy would try to evaluate exactly.
    if re.search(r"\^\s*\(?\s*\d{4,}", s) or s.count("^") + s.count("**") > 4:
        return None
    try:
        transformations = standard_transformations + (
            implicit_multiplication_application,
            convert_xor,
        )
        return parse_expr(s, transformations=transformations, evaluate=True)
    except Exception:  # noqa: BLE001 - anything unparsable is simply "not symbolic"
        return None


def _split_top_level(s: str) -> list[str]:
    """Split on commas not nested in brackets: '(1,2),3' → ['(1,2)', '3']."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def symbolically_equal(a: str, b: str) -> bool:
    """True when both parse and their difference simplifies to 0 (numbers: within 1e-9)."""
    import sympy

    ea, eb = latex_to_sympy(a), latex_to_sympy(b)
    if ea is None or eb is None:
        return False
    try:
        diff = ea - eb
        if not diff.free_symbols:
            value = complex(sympy.N(diff, 30))
            scale = max(1.0, abs(complex(sympy.N(eb, 30))))
            return abs(value) <= 1e-9 * scale
        return sympy.simplify(diff) == 0
    except Exception:  # noqa: BLE001 - e.g. comparisons of incompatible objects
        return False


def math_answers_equal(pred: str | None, ref: str | None) -> bool:
    """MATH equivalence: normalised strings equal, or (element-wise for tuples / lists)
    symbolically equal."""
    if pred is None or ref is None:
        return False
    a, b = normalize_math_answer(pred), normalize_math_answer(ref)
    if a == b:
        return True
    brackets = "()[]"
    if a[:1] in brackets and b[:1] in brackets and a[:1] != b[:1]:
        return False  # an open interval is not a closed one
    pa, pb = _split_top_level(a.strip("()[]")), _split_top_level(b.strip("()[]"))
    if len(pa) != len(pb):
        return False
    if len(pa) > 1:
        return all(x == y or symbolically_equal(x, y) for x, y in zip(pa, pb))
    return symbolically_equal(a, b)


# ---------------------------------------------------------------- MATH: math-verify

MATH_CHECKERS = ("hybrid", "math-verify", "mergelab")
MATH_VERIFY_TIMEOUT_S = 5  # math-verify's default, per parse / comparison


def math_verify_correct(generation: str, reference: str) -> bool:
    """math-verify's verdict on a whole generation, as harnesses call it: the gold is parsed
    from ``\\boxed{reference}`` (what a MATH solution ends with), the prediction from the text.

    math-verify bounds each step with ``signal.alarm``, which only the main thread may use;
    elsewhere it runs without its timeout.
    """
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError(
            "the MATH checker 'math-verify' needs the math-verify package: "
            "pip install math-verify (or choose the checker 'mergelab')"
        ) from None
    timeout = (
        MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    )
    gold = parse("\\boxed{" + reference + "}", parsing_timeout=timeout)
    pred = parse(generation, parsing_timeout=timeout)
    return bool(verify(gold, pred, timeout_seconds=timeout))


def math_correct(
    generation: str, reference: str, checker: str = "hybrid"
) -> tuple[bool, str | None]:
    """(correct, extracted answer) for one MATH generation, by ``checker`` (see the module
    docstring). The extracted answer is always the own extraction (last box), for reports."""
    pred = extract_math_answer(generation)
    if checker == "mergelab":
        return math_answers_equal(pred, reference), pred
    if checker not in MATH_CHECKERS:
        raise ValueError(f"MATH checker must be one of {MATH_CHECKERS}, got {checker!r}")
    if math_verify_correct(generation, reference):
        return True, pred
    if checker == "hybrid" and pred is not None:
        return normalize_math_answer(pred) == normalize_math_answer(reference), pred
    return False, pred


# ---------------------------------------------------------------- scoring a benchmark


def extract_final_answer_line(text: str) -> str | None:
    """The integer of a last non-empty line that is exactly ``#### n`` (None otherwise).

    The strict rule of the synthetic sets: an answer counts only as the final ``#### n`` line, not
    as a number found anywhere (e.g. inside an enumeration ``1 apple 2 river``)."""
    lines = [ln.strip() for ln in text.strip().splitlines()]
    m = _FINAL_LINE.fullmatch(lines[-1]) if lines else None
    return m.group(1) if m else None


_FINAL_LINE = re.compile(r"####\s*(-?\d+)")


def final_line_correct(generation: str, reference: str) -> tuple[bool, str | None]:
    """(correct, extracted answer) under :func:`extract_final_answer_line`."""
    pred = extract_final_answer_line(generation)
    return numbers_equal(pred, reference), pred


def answer_scorer(check, summary_extra=None, *, whole_record=False):
    """A task scorer for answer tasks: ``check(text, item, settings)`` → ``(correct, extracted)``
    per sample; per item, accuracy = the fraction of correct samples. ``summary_extra(settings)``
    adds entries to the summary (e.g. the checker's version). ``whole_record``: ``check`` gets
    the sample's whole generation record (``text``, ``finish_reason``, ``n_tokens``, …) instead
    of its text, for tasks whose verdict depends on how the generation ended."""
    from mergelab.eval.tasks import TaskScores

    def score(benchmark, samples, settings, *, sandbox=None, progress=False) -> TaskScores:
        items, per_item = [], []
        for it in benchmark.items:
            recs = []
            for rec in samples[it.item_id]:
                ok, pred = check(rec if whole_record else rec["text"], it, settings)
                recs.append(
                    {
                        "text": rec["text"],
                        "finish_reason": rec["finish_reason"],
                        "extracted": pred,
                        "correct": ok,
                    }
                )
            acc = sum(r["correct"] for r in recs) / len(recs)
            per_item.append(acc)
            items.append(
                {
                    "item_id": it.item_id,
                    "reference": it.answer,
                    "scores": {"accuracy": acc},
                    "samples": recs,
                }
            )
        extra = summary_extra(settings) if summary_extra else {}
        return TaskScores(items, {"accuracy": per_item}, "accuracy", extra)

    return score


def math_checker_versions(settings) -> dict:
    """Which MATH checker scored the run, with the math-verify version it used (if any)."""
    from importlib.metadata import PackageNotFoundError, version

    record: dict = {"checker": settings.math_checker}
    if settings.math_checker != "mergelab":
        try:
            record["math_verify"] = version("math-verify")
        except PackageNotFoundError:  # math_correct has already said how to install it
            record["math_verify"] = None
    return {"math_checker": record}
