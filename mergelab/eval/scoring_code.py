"""Code benchmarks: test completions, and pass@k.

A completion is tested up to twice: ``base`` (the benchmark's own tests) and ``plus`` (EvalPlus's
extra inputs); as in EvalPlus, it counts for the plus score only when it passes both. The
completion's code only computes: it runs in the sandbox and returns its function's outputs for
the test inputs as plain data; whether they are right is decided here, in the trusted process,
which never runs model-written code (:func:`run_code_tests`, docs/sandbox.md). Differential tests
(EvalPlus ``base_input``/``plus_input``) compare with ``canonical_solution``'s outputs: exactly,
or within ``atol`` for floats (1e-6 when ``atol`` is 0, as EvalPlus enforces). One wall-clock
timeout covers all of a completion's calls of one kind (EvalPlus times each input against the
reference's time instead).
"""

from __future__ import annotations

import builtins
import copy
import math
import random
import re
import reprlib
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from math import comb

import numpy as np

from mergelab.eval.benchmarks import CodeTests

# MBPP+ tasks whose outputs EvalPlus compares as sets (order-free).
SET_EQUAL_ENTRY_POINTS = frozenset(
    {
        "similar_elements",
        "find_char_long",
        "common_in_nested_lists",
        "extract_singly",
        "larg_nnum",
        "intersection_array",
        "find_dissimilar",
        "Diff",
    }
)

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


@dataclass(frozen=True)
class TestVerdict:
    """How a solution did on one kind of test ("base" or "plus"): ``status`` is "passed",
    "failed" (a wrong output), "crashed" (it raised, or its program broke), "timed_out", or
    "untestable" (the item's tests cannot be run apart from the solution; ``error`` says why).
    Decided here, in the trusted process, from the solution's outputs alone."""

    status: str
    error: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def test_kinds(tests: CodeTests) -> tuple[str, ...]:
    """The kinds of test an item has: ("base",) or ("base", "plus")."""
    return ("base", "plus") if tests.has_plus else ("base",)


def run_code_tests(
    sandbox,
    cases: Sequence[tuple[str, str, CodeTests]],
    limits=None,
    progress: bool = False,
    desc: str = "testing",
) -> tuple[list[dict[str, TestVerdict]], list[str]]:
    """Test each ``(prompt, solution source, tests)`` case (the source as
    :func:`solution_code` builds it); returns one {kind: verdict} per case, and the isolation
    tags the sandbox reported.

    Untrusted code only computes: the solution runs in ``sandbox`` (a
    :class:`~mergelab.eval.sandbox.Sandbox`) and returns its entry point's outputs for the test
    inputs as plain data; the expected outputs never enter its process. Everything that judges
    runs here. First, once per item and before any solution runs, a sandbox job that holds only
    benchmark code (the reference solution and the tests) gives the test inputs: EvalPlus's
    ``base_inputs``/``plus_inputs`` with the reference outputs, or for ``check`` /
    ``asserts`` tests the calls the tests make, recorded while they test the reference solution.
    Then each solution is called on those inputs in the sandbox. Last, here: outputs are
    compared with EvalPlus's rules, or the tests' own code runs again with a stand-in for the
    solution that answers each call with the solution's recorded output (the asserts' own
    operators and tolerances judge; a test whose calls change with the outputs is
    "untestable"). See docs/sandbox.md.
    """
    from mergelab.eval.sandbox import CallRequest

    plans: dict[int, dict[str, _Reference]] = {}
    ref_jobs: list[tuple[int, str, CallRequest]] = []
    for prompt, _, tests in cases:
        if id(tests) in plans:
            continue
        plans[id(tests)] = {}
        for kind in test_kinds(tests):
            cache_key = repr((prompt, kind, tests))
            ref = _REFERENCES.get(cache_key) or _Reference(tests, kind, prompt)
            plans[id(tests)][kind] = ref
            if ref.request is not None and not ref.done:
                ref_jobs.append((id(tests), kind, ref.request, cache_key))
    ref_results = sandbox.call_many(
        [r for _, _, r, _ in ref_jobs], limits, progress, desc=f"{desc} (reference)"
    )
    isolation = {tag for r in ref_results for tag in r.isolation}
    for (key, kind, _, cache_key), result in zip(ref_jobs, ref_results):
        ref = plans[key][kind]
        ref.read(result)
        if ref.done and len(_REFERENCES) < 100_000:  # the same tests: the same inputs
            _REFERENCES[cache_key] = ref

    jobs, where = [], []
    for i, (_, solution, tests) in enumerate(cases):
        for kind, ref in plans[id(tests)].items():
            if ref.untestable is None:
                jobs.append(CallRequest(solution, tests.entry_point, ref.inputs))
                where.append((i, kind))
    results = sandbox.call_many(jobs, limits=limits, progress=progress, desc=desc)
    isolation |= {tag for r in results for tag in r.isolation}
    verdicts: list[dict[str, TestVerdict]] = [
        {k: TestVerdict("untestable", ref.untestable) for k, ref in plans[id(t)].items()}
        for *_, t in cases
    ]
    for (i, kind), result in zip(where, results):
        verdicts[i][kind] = plans[id(cases[i][2])][kind].judge(result)
    return verdicts, sorted(isolation)


# Reference runs that completed, by (prompt, kind, tests): every candidate scored in this
# process on the same benchmark reuses them.
_REFERENCES: dict[str, _Reference] = {}


class _Reference:
    """One item's tests of one kind: the sandbox job that gives their inputs (benchmark code
    only), then the judgement of a solution's outputs on them."""

    def __init__(self, tests: CodeTests, kind: str, prompt: str):
        from mergelab.eval.sandbox import CallRequest

        self.tests, self.kind, self.prompt = tests, kind, prompt
        self.untestable: str | None = None
        self.done = False  # the reference job completed and was read
        self.inputs: list[tuple[list, dict]] = []
        self.expected: list = []
        self.request = None
        self.replay = kind == "base" and bool(tests.check or tests.asserts)
        if self.replay:
            self.request = CallRequest(_recording_program(tests), _RECORD, [((), {})])
            return
        inputs = tests.base_inputs if kind == "base" else tests.plus_inputs
        if inputs is None:
            raise ValueError(f"no base tests for entry point {tests.entry_point!r}")
        if not tests.canonical_solution:
            self.untestable = "differential tests without a reference solution"
            return
        self.inputs = [(list(inp), {}) for inp in inputs]
        self.request = CallRequest(tests.canonical_solution, tests.entry_point, self.inputs)

    def read(self, result) -> None:
        """Take the reference job's result: the inputs (and, for differential tests, the
        expected outputs), or the reason the item cannot be tested."""
        if result.status != "completed":
            self.untestable = f"the reference run {result.status}: {result.error.strip()[-300:]}"
            return
        self.done = True
        if not self.replay:
            bad = [(i, o) for i, o in enumerate(result.outcomes) if o.kind != "value"]
            if bad:
                i, o = bad[0]
                self.untestable = f"the reference solution fails on input #{i}: {o.text}"
            self.expected = [o.value for o in result.outcomes]
            return
        (outcome,) = result.outcomes
        if outcome.kind == "invalid":
            self.untestable = (
                "the tests call the function with values that are not plain data "
                f"({outcome.text}): they cannot run apart from the solution"
            )
            return
        if outcome.kind != "value":
            self.untestable = f"recording the tests' calls failed: {outcome.text}"
            return
        record = outcome.value
        if type(record) is not dict or set(record) != {"calls", "failure"}:
            self.untestable = "recording the tests' calls returned something else"
            return
        if record["failure"] is not None:
            source = "the reference solution" if self.tests.canonical_solution else "a stand-in"
            self.untestable = f"the tests fail with {source}: {record['failure']}"
            return
        self.inputs = [(list(args), kwargs) for args, kwargs in record["calls"]]
        self.keys = [_call_key(args, kwargs) for args, kwargs in self.inputs]

    def judge(self, result) -> TestVerdict:
        if result.status != "completed":
            return TestVerdict(result.status, result.error.strip()[-1000:])
        if self.replay:
            return self._replay(result.outcomes)
        return self._compare(result.outcomes)

    def _compare(self, outcomes) -> TestVerdict:
        """EvalPlus's differential check: exact, or within ``atol`` for floats (1e-6 when
        ``atol`` is 0, as EvalPlus enforces); sets and polynomial roots by their own rules."""
        mode, atol = _compare_mode(self.tests.entry_point), float(self.tests.atol)
        for i, (o, exp, (args, _)) in enumerate(zip(outcomes, self.expected, self.inputs)):
            if o.kind == "raised":
                return TestVerdict("crashed", f"input #{i}: {_short(args)}: raised {o.text}")
            if o.kind == "invalid" or not _same(o.value, exp, atol, mode, args):
                got = o.text if o.kind == "invalid" else _short(o.value)
                return TestVerdict(
                    "failed", f"input #{i}: {_short(args)} -> expected {_short(exp)}, got {got}"
                )
        return TestVerdict("passed")

    def _replay(self, outcomes) -> TestVerdict:
        """Run the tests' own code here, the solution replaced by its recorded outputs."""
        calls = [0]

        def stand_in(*args, **kwargs):
            i = calls[0]
            calls[0] += 1
            try:
                key = _call_key(args, kwargs)
            except ValueError:  # not plain data: the reference run passed plain data here
                raise _Diverged(i) from None
            if i >= len(self.keys) or key != self.keys[i]:
                raise _Diverged(i)
            o = outcomes[i]
            if o.kind == "value":
                return copy.deepcopy(o.value)
            if o.kind == "invalid":
                raise _NotPlain(i, o.text)
            raise _exception(o, i)

        state = random.getstate()
        try:
            _run_tests(self.tests, self.prompt, stand_in)
        except _Diverged as exc:
            return TestVerdict(
                "untestable",
                f"call #{exc.args[0]} of the tests differs from the reference run: the tests' "
                "calls depend on the solution's outputs, so they cannot run apart from it",
            )
        except _NotPlain as exc:
            return TestVerdict("failed", f"call #{exc.args[0]} returned {exc.args[1]}")
        except NameError as exc:
            if getattr(exc, "_mergelab_call", None) is not None:  # the solution's own
                return TestVerdict("crashed", f"call #{exc._mergelab_call} raised NameError: {exc}")
            reason = f"the tests need a name the solution defines ({exc})"
            return TestVerdict("untestable", f"{reason}: they cannot run apart from it")
        except AssertionError as exc:
            return TestVerdict("failed", _failed_assert(exc, self.tests, calls[0]))
        except Exception as exc:  # noqa: BLE001 - the tests broke on the outputs
            i = getattr(exc, "_mergelab_call", None)
            if i is not None:
                return TestVerdict("crashed", f"call #{i} raised {type(exc).__name__}: {exc}")
            return TestVerdict(
                "crashed", f"the tests raised {type(exc).__name__}: {_short_text(exc)}"
            )
        finally:
            random.setstate(state)
        return TestVerdict("passed")


_RECORD = "__mergelab_record_calls__"
# Appended to benchmark code only (the reference solution and the tests), never to a solution's.
_RECORDER_SOURCE = r'''
def __mergelab_recorded(run_tests, target):
    import copy, random, traceback
    calls, depth = [], [0]

    def recorder(*args, **kwargs):
        if depth[0]:  # a recursive call of the reference through its global name
            return target(*args, **kwargs)
        calls.append([list(copy.deepcopy(args)), copy.deepcopy(kwargs)])
        depth[0] += 1
        try:
            return target(*args, **kwargs)
        finally:
            depth[0] -= 1

    random.seed(0)
    failure = None
    try:
        run_tests(recorder)
    except BaseException as exc:
        failure = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-500:]
    return {"calls": calls, "failure": failure}


class __MergelabStandIn:
    """Without a reference solution: equal to anything, so straight asserts record their
    calls."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    def __hash__(self):
        return 0

    def __sub__(self, other):
        return self

    __rsub__ = __add__ = __radd__ = __sub__

    def __abs__(self):
        return 0.0


def __mergelab_stand_in(*args, **kwargs):
    return __MergelabStandIn()
'''


def _recording_program(tests: CodeTests) -> str:
    """A program of benchmark code only: the reference solution (or a stand-in that equals
    anything), the tests, and a function that runs the tests and returns the calls they made."""
    reference = tests.canonical_solution
    target = tests.entry_point if reference else "__mergelab_stand_in"
    # Calls through the function's global name count too (HumanEval/33's check compares
    # candidate(x) with sort_third(x)): the tests' module sees the recorder under that name.
    bind = f"globals().__setitem__({tests.entry_point!r}, candidate)"
    if tests.check:
        run = f"lambda candidate: ({bind}, check(candidate))"
        parts = [reference, tests.check]
    else:
        asserts = "\n".join(tests.asserts)
        run = f"lambda candidate: ({bind}, exec({asserts!r}, globals()))"
        parts = [tests.setup, reference]
    entry = f"def {_RECORD}():\n    return __mergelab_recorded({run}, {target})\n"
    return "\n\n".join([*parts, _RECORDER_SOURCE, entry])


def _run_tests(tests: CodeTests, prompt: str, candidate) -> None:
    """The tests' own code, calling ``candidate``: benchmark code, run in this process."""
    namespace: dict = {"__name__": "__mergelab_tests__"}
    if tests.check:
        if tests.prompt_is_code:  # the prompt's helpers (HumanEval/32's poly, ...)
            try:
                exec(compile(prompt, "<prompt>", "exec"), namespace)
            except Exception:  # noqa: BLE001 - a prompt that is not code on its own
                pass
        exec(compile(tests.check, "<tests>", "exec"), namespace)
        namespace[tests.entry_point] = candidate
        random.seed(0)
        namespace["check"](candidate)
    else:
        exec(compile(tests.setup, "<setup>", "exec"), namespace)
        namespace[tests.entry_point] = candidate
        random.seed(0)
        exec(compile("\n".join(tests.asserts), "<tests>", "exec"), namespace)


def _failed_assert(exc: AssertionError, tests: CodeTests, n_calls: int) -> str:
    """ "AssertionError at line N of the tests: <that line>: <message>"."""
    source = tests.check or "\n".join(tests.asserts)
    lineno = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_filename == "<tests>":
            lineno = line
    text = "AssertionError"
    if lineno is not None and 0 < lineno <= len(source.splitlines()):
        text += f" at line {lineno} of the tests: {source.splitlines()[lineno - 1].strip()[:200]}"
    message = _short_text(exc)
    return text + (f": {message}" if message else "") + f" (after {n_calls} calls)"


class _Diverged(Exception):
    """The tests made a call the reference run did not (args: the call's index)."""


class _NotPlain(Exception):
    """The solution's output for a call was not plain data (args: index, reason)."""


def _call_key(args, kwargs) -> str:
    from mergelab.eval import plain_data

    return plain_data.dumps([list(args), dict(kwargs)])


def _exception(outcome, i: int) -> BaseException:
    """The solution's exception as a built-in exception of the same name (so that tests
    expecting one, ``except ValueError``, still work), else a RuntimeError."""
    cls = getattr(builtins, outcome.raised, None)
    message = outcome.text.split(": ", 1)[-1]
    exc: BaseException
    try:
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            raise TypeError
        exc = cls(message)
    except Exception:  # noqa: BLE001 - a built-in that wants other arguments
        exc = RuntimeError(outcome.text)
    exc._mergelab_call = i  # type: ignore[attr-defined]
    return exc


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 200
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 20


def _short(value) -> str:
    return _REPR.repr(value)[:300]


def _short_text(exc: BaseException) -> str:
    return str(exc)[:300]


def _is_floats(x) -> bool:
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)) and x:
        return all(isinstance(i, float) for i in x)
    return False


def _close(out, exp, atol: float) -> bool:
    if isinstance(exp, (list, tuple)):
        if not isinstance(out, (list, tuple)) or len(out) != len(exp):
            return False
        return all(_close(o, e, atol) for o, e in zip(out, exp))
    try:
        if math.isnan(exp) and math.isnan(out):
            return True
        return abs(out - exp) <= atol + 1e-7 * abs(exp)
    except TypeError:
        return out == exp


def _same(out, exp, atol: float, mode: str, args) -> bool:
    """EvalPlus's comparison of one output with the reference's (values of built-in types)."""
    try:
        if mode == "set":
            return set(out) == set(exp)
        if mode == "poly_root":  # HumanEval/32 find_zero: any root is fine
            xs = args[0]
            return abs(sum(c * math.pow(out, i) for i, c in enumerate(xs))) <= max(atol, 1e-6)
        if out == exp:
            return True
        if atol == 0 and _is_floats(exp):
            atol = 1e-6
        return atol != 0 and _close(out, exp, atol)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return False


def _compare_mode(entry_point: str) -> str:
    if entry_point == "find_zero":
        return "poly_root"
    if entry_point in SET_EQUAL_ENTRY_POINTS:
        return "set"
    return "exact"


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
    """The code tasks' scorer: every sample's solution is tested against the item's tests
    (:func:`run_code_tests`: the solution runs in the sandbox, ``sandbox`` or a new one from
    ``settings``; the verdict is reached outside it); pass@k per item for the base tests and,
    where items have EvalPlus tests, for base + plus (both must pass)."""
    from mergelab.eval.sandbox import Sandbox
    from mergelab.eval.tasks import TaskScores

    cases, index = [], []
    for it in benchmark.items:
        for s, rec in enumerate(samples[it.item_id]):
            cases.append((it.prompt, solution_code(it.prompt, rec["text"], it.tests), it.tests))
            index.append((it.item_id, s))
    own = sandbox is None
    sandbox = sandbox or Sandbox(
        workers=settings.workers,
        limits=settings.sandbox,
        isolation=settings.isolation,
        memory_limit=settings.memory_limit,
        packages=settings.packages,
    )
    memory_notice = sandbox.memory_notice(settings.sandbox)
    try:
        verdicts, isolation = run_code_tests(
            sandbox, cases, settings.sandbox, progress, desc=f"testing {benchmark.name}"
        )
    finally:
        if own:
            sandbox.close()
    outcome = dict(zip(index, verdicts))
    has_plus = any(it.tests.has_plus for it in benchmark.items)
    items: list[dict] = []
    metrics: dict[str, list[float]] = {}
    untestable = set()
    for it in benchmark.items:
        recs = []
        for s, rec in enumerate(samples[it.item_id]):
            verdict = outcome[(it.item_id, s)]
            base = verdict["base"]
            entry = {
                "text": rec["text"],
                "finish_reason": rec["finish_reason"],
                "program": solution_code(it.prompt, rec["text"], it.tests),
                "base": {"status": base.status, "error": base.error[-1000:]},
                "base_passed": base.passed,
            }
            if it.tests.has_plus:
                plus = verdict["plus"]
                entry["plus"] = {"status": plus.status, "error": plus.error[-1000:]}
                entry["plus_passed"] = base.passed and plus.passed  # EvalPlus: both must pass
            if any(v.status == "untestable" for v in verdict.values()):
                untestable.add(it.item_id)
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
    primary = (
        "pass@1_plus"
        if has_plus and 1 in settings.pass_k
        else (f"pass@{settings.pass_k[0]}_{'plus' if has_plus else 'base'}")
    )
    meta = {"sandbox_isolation": isolation, "sandbox_memory": memory_notice}
    if untestable:
        meta["untestable_items"] = sorted(untestable)
    return TaskScores(items, metrics, primary, meta)
