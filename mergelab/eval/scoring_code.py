"""Code benchmarks: turn a completion into test programs, and pass@k.

Each completion becomes up to two programs, run in the sandbox: ``base`` (the benchmark's own
tests) and ``plus`` (EvalPlus's extra inputs). As in EvalPlus, a completion counts for the plus
score only when it passes both. Differential tests (EvalPlus ``base_input``/``plus_input``)
first compute the reference outputs with ``canonical_solution`` — before any model code runs, in
a separate namespace of the same sandboxed process — then call the completion on deep copies of
the same inputs and compare: exactly, or within ``atol`` for floats (1e-6 when ``atol`` is 0,
as EvalPlus enforces). One wall-clock timeout covers a whole program (EvalPlus times each input
against the reference's time instead).
"""

from __future__ import annotations

import base64
import pickle
import re
from collections.abc import Sequence
from math import comb

import numpy as np

from mergelab.eval.benchmarks import CodeTests

# MBPP+ tasks whose outputs EvalPlus compares as sets (order-free).
SET_EQUAL_ENTRY_POINTS = frozenset(
    {"similar_elements", "find_char_long", "common_in_nested_lists", "extract_singly",
     "larg_nnum", "intersection_array", "find_dissimilar", "Diff"}
)  # fmt: skip

_FENCE = re.compile(r"```(?:[Pp]ython3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The code in a completion: the first fenced block that defines ``entry_point`` (else the
    first fenced block); the completion itself when there is no fence."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    if entry_point:
        for b in blocks:
            if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", b, re.M):
                return b
    return blocks[0]


def solution_code(prompt: str, completion: str, tests: CodeTests) -> str:
    """The full program text of a candidate solution (without tests).

    HumanEval-style items continue the prompt, unless the model rewrote the whole function
    (chat models do): then the prompt's imports are kept and the model's code is used as is.
    """
    code = extract_code(completion, tests.entry_point)
    if not tests.prompt_is_code:
        return code
    if re.search(rf"^def\s+{re.escape(tests.entry_point)}\s*\(", code, re.M):
        imports = "\n".join(ln for ln in prompt.splitlines() if ln.startswith(("import ", "from ")))
        return imports + "\n" + code
    return prompt + completion


def _literal(obj) -> str:
    """Python source that rebuilds ``obj`` (tuples, sets, complex, inf included)."""
    data = base64.b64encode(pickle.dumps(obj, protocol=4)).decode("ascii")
    return f"__pickle.loads(__base64.b64decode({data!r}))"


_COMPARE_SOURCE = r"""
import base64 as __base64, copy as __copy, math as __math, pickle as __pickle


def __is_floats(x):
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)) and x:
        return all(isinstance(i, float) for i in x)
    return False


def __close(out, exp, atol):
    if isinstance(exp, (list, tuple)):
        if not isinstance(out, (list, tuple)) or len(out) != len(exp):
            return False
        return all(__close(o, e, atol) for o, e in zip(out, exp))
    try:
        if __math.isnan(exp) and __math.isnan(out):
            return True
        return abs(out - exp) <= atol + 1e-7 * abs(exp)
    except TypeError:
        return out == exp


def __same(out, exp, atol, mode, inp):
    if mode == "set":
        try:
            return set(out) == set(exp)
        except TypeError:
            return False
    if mode == "poly_root":  # HumanEval/32 find_zero: any root is fine
        xs = inp[0]
        return abs(sum(c * __math.pow(out, i) for i, c in enumerate(xs))) <= max(atol, 1e-6)
    if out == exp:
        return True
    if atol == 0 and __is_floats(exp):
        atol = 1e-6
    return atol != 0 and __close(out, exp, atol)


def __differential(reference_src, candidate_src, entry_point, inputs, atol, mode):
    ref_ns = {"__name__": "__reference__"}
    exec(reference_src, ref_ns)
    reference = ref_ns[entry_point]
    expected = [reference(*__copy.deepcopy(inp)) for inp in inputs]
    cand_ns = {"__name__": "__main__"}
    exec(candidate_src, cand_ns)
    if entry_point not in cand_ns:
        raise NameError(f"the solution does not define {entry_point!r}")
    fn = cand_ns[entry_point]
    for i, (inp, exp) in enumerate(zip(inputs, expected)):
        out = fn(*__copy.deepcopy(inp))
        if not __same(out, exp, atol, mode, inp):
            raise AssertionError(
                f"input #{i}: {repr(inp)[:300]} -> expected {repr(exp)[:300]}, got {repr(out)[:300]}"
            )
"""


def _compare_mode(entry_point: str) -> str:
    if entry_point == "find_zero":
        return "poly_root"
    if entry_point in SET_EQUAL_ENTRY_POINTS:
        return "set"
    return "exact"


def _differential_program(solution: str, tests: CodeTests, inputs: list) -> str:
    return (
        _COMPARE_SOURCE
        + "\n__differential("
        + f"{tests.canonical_solution!r}, {solution!r}, {tests.entry_point!r}, "
        + f"{_literal(inputs)}, {float(tests.atol)!r}, {_compare_mode(tests.entry_point)!r})\n"
    )


def build_test_programs(prompt: str, completion: str, tests: CodeTests) -> dict[str, str]:
    """{"base": program} and, for EvalPlus items, {"plus": program}; each passes iff it exits
    normally."""
    solution = solution_code(prompt, completion, tests)
    programs: dict[str, str] = {}
    if tests.check:
        programs["base"] = f"{solution}\n\n{tests.check}\n\ncheck({tests.entry_point})\n"
    elif tests.asserts:
        asserts = "\n".join(tests.asserts)
        programs["base"] = f"{tests.setup}\n{solution}\n\n{asserts}\n"
    elif tests.base_inputs is not None:
        programs["base"] = _differential_program(solution, tests, tests.base_inputs)
    else:
        raise ValueError(f"no base tests for entry point {tests.entry_point!r}")
    if tests.plus_inputs is not None:
        programs["plus"] = _differential_program(solution, tests, tests.plus_inputs)
    return programs


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021): 1 − C(n−c, k) / C(n, k), for n samples of which c
    pass. Requires k ≤ n."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def mean_pass_at_k(num_samples: Sequence[int], num_correct: Sequence[int], k: int) -> float:
    """pass@k averaged over problems."""
    return float(np.mean([pass_at_k(n, c, k) for n, c in zip(num_samples, num_correct)]))


def score_code(benchmark, samples, settings, *, sandbox=None, progress=False):
    """The code tasks' scorer: every sample's program is run against the item's tests in the
    sandbox (``sandbox`` or a new one from ``settings``); pass@k per item for the base tests and,
    where items have EvalPlus tests, for base + plus (both must pass)."""
    from mergelab.eval.sandbox import Sandbox
    from mergelab.eval.tasks import TaskScores

    programs, index = [], []
    for it in benchmark.items:
        for s, rec in enumerate(samples[it.item_id]):
            for kind, prog in build_test_programs(it.prompt, rec["text"], it.tests).items():
                programs.append(prog)
                index.append((it.item_id, s, kind))
    own = sandbox is None
    sandbox = sandbox or Sandbox(
        workers=settings.workers, limits=settings.sandbox, isolation=settings.isolation
    )
    try:
        results = sandbox.run_many(programs, limits=settings.sandbox, progress=progress,
                                   desc=f"testing {benchmark.name}")  # fmt: skip
    finally:
        if own:
            sandbox.close()
    outcome = {key: res for key, res in zip(index, results)}
    has_plus = any(it.tests.has_plus for it in benchmark.items)
    items: list[dict] = []
    metrics: dict[str, list[float]] = {}
    for it in benchmark.items:
        recs = []
        for s, rec in enumerate(samples[it.item_id]):
            base = outcome[(it.item_id, s, "base")]
            entry = {
                "text": rec["text"],
                "finish_reason": rec["finish_reason"],
                "program": solution_code(it.prompt, rec["text"], it.tests),
                "base": {"status": base.status, "error": base.error[-1000:]},
                "base_passed": base.passed,
            }
            if it.tests.has_plus:
                plus = outcome[(it.item_id, s, "plus")]
                entry["plus"] = {"status": plus.status, "error": plus.error[-1000:]}
                entry["plus_passed"] = base.passed and plus.passed  # EvalPlus: both must pass
            recs.append(entry)
        n = len(recs)
        scores = {}
        for k in settings.pass_k:
            scores[f"pass@{k}_base"] = pass_at_k(n, sum(r["base_passed"] for r in recs), k)
            if has_plus:
                c_plus = sum(r.get("plus_passed", False) for r in recs)
                scores[f"pass@{k}_plus"] = pass_at_k(n, c_plus, k)
        for name, v in scores.items():
            metrics.setdefault(name, []).append(v)
        items.append({"item_id": it.item_id, "scores": scores, "samples": recs})
    primary = "pass@1_plus" if has_plus and 1 in settings.pass_k else (
        f"pass@{settings.pass_k[0]}_{'plus' if has_plus else 'base'}"
    )  # fmt: skip
    isolation = sorted({tag for r in results for tag in r.isolation})
    return TaskScores(items, metrics, primary, {"sandbox_isolation": isolation})
