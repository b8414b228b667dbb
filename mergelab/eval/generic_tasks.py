"""Tasks over your own data: a file of records and field templates, no Python.

Five tasks, registered like mergelab's own (:func:`generic_task` builds each):

* ``exact_match`` — the completion's first line (stripped) equals the target (stripped);
* ``normalized_match`` — equal after SQuAD's normalisation (lower case, punctuation and the
  articles a/an/the removed, whitespace collapsed);
* ``regex`` — ``pattern`` is searched in the completion (no default stop string); its first
  group (the whole match if it has none) equals the target (stripped); lm-eval's ``regex`` filter
  followed by ``exact_match``;
* ``multiple_choice`` — no generation: the candidate's log-likelihood of each choice after the
  prompt (``delimiter`` + choice, lm-eval's ``target_delimiter``, ``" "`` by default); ``acc`` is
  whether the most likely choice is the labelled one, ``acc_norm`` the same with each
  log-likelihood divided by its choice's length in characters (lm-eval's ``acc``/``acc_norm``);
* ``code_tests`` — the completion (after the prompt when ``prompt_is_code``, the default) run
  with the record's ``tests`` (a list of assert lines or one block of test code, after
  ``setup``) in the sandbox, as the ``code`` task runs them; ``entry_point`` names the function.

Records come from JSONL (``.jsonl``/``.jsonl.gz``), a JSON list, CSV, Parquet (needs
``pyarrow``) or a folder written by Hugging Face ``datasets``' ``save_to_disk`` (needs
``datasets``; a ``DatasetDict`` needs ``split``). ``fields`` says how a record becomes an item,
in lm-eval's spirit (``doc_to_text``, ``doc_to_target``, ``doc_to_choice``):

    fields = {"prompt": "Question: {x}\\nAnswer:", "target": "{y}"}                 # answers
    fields = {"prompt": "{x}", "choices": "choices", "label": "label"}              # choices
    fields = {"prompt": "{q}", "choices": ["{a}", "{b}", "{c}"], "label": "answer"}

A value with ``{`` is a template (``str.format`` over the record: ``{x}``, ``{choices[0]}``); one
without is a field name, whose value is taken as it is. ``choices`` is a field holding a list
(in CSV: a JSON list), or a list of templates; ``label`` a field holding the right choice's
index (0-based) or its text; with ``target`` instead of ``label`` the target must be one of the
choices. ``id`` names the field of the item ids (default: the record's line number). A field a
template uses that a record lacks is one line naming the field, the key and the file's line.

Everything a scorer needs is rendered into the items (prompt, answer, choices, label, pattern),
so a worker that has only the benchmark — a Ray task, a resumed run — scores it the same way.
"""

from __future__ import annotations

import csv
import json
import os
import re
import string
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from mergelab.eval.benchmarks import (
    Benchmark,
    BenchmarkFormatError,
    CodeTests,
    Item,
    read_records,
)
from mergelab.eval.prompts import code_stop_strings
from mergelab.eval.scoring_code import score_code
from mergelab.eval.scoring_math import answer_scorer
from mergelab.eval.tasks import Task, TaskScores, register_task

GENERIC_TASKS = ("exact_match", "normalized_match", "regex", "multiple_choice", "code_tests")
FIELD_KEYS = (
    "prompt",
    "target",
    "choices",
    "label",
    "id",
    "pattern",
    "delimiter",
    "tests",
    "entry_point",
    "setup",
    "prompt_is_code",
)
CODE_KEYS = ("tests", "entry_point", "setup", "prompt_is_code")
# Field names used when ``fields`` leaves them out.
DEFAULT_FIELDS = {"prompt": "prompt", "target": "target", "choices": "choices", "label": "label"}


# ---------------------------------------------------------------- reading a file of records


def read_table(path: str | os.PathLike, split: str | None = None) -> Iterator[tuple[int, dict]]:
    """(line or row number, record) of every record of a JSONL/JSON/CSV/Parquet file or a
    ``datasets`` folder (``split`` picks a ``DatasetDict``'s split)."""
    path = Path(path)
    if path.is_dir():
        yield from _datasets_folder(path, split)
        return
    if split is not None:
        raise BenchmarkFormatError(f"{path}: `split` is for a datasets folder, not a file")
    name = path.name.lower()
    if name.endswith(".csv"):
        with open(path, encoding="utf-8-sig", newline="") as f:
            for lineno, row in enumerate(csv.DictReader(f), start=2):  # line 1: the header
                yield lineno, dict(row)
    elif name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise BenchmarkFormatError(
                f"{path}: reading Parquet needs pyarrow (pip install pyarrow)"
            ) from None
        yield from enumerate(pq.read_table(path).to_pylist(), start=1)
    else:
        yield from read_records(path)


def _datasets_folder(path: Path, split: str | None) -> Iterator[tuple[int, dict]]:
    try:
        import datasets
    except ImportError:
        raise BenchmarkFormatError(
            f"{path}: a folder is read as a Hugging Face datasets folder, which needs "
            "`datasets` (pip install datasets)"
        ) from None
    try:
        data = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise BenchmarkFormatError(f"{path}: not a datasets save_to_disk folder ({exc})") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise BenchmarkFormatError(
                f"{path}: a DatasetDict; name its split with `split:` (one of {sorted(data)})"
            )
        data = data[split]
    elif split is not None:
        raise BenchmarkFormatError(f"{path}: one Dataset, no splits; drop `split: {split}`")
    for i, rec in enumerate(data, start=1):
        yield i, dict(rec)


# ---------------------------------------------------------------- templates


def template_fields(template: str) -> list[str]:
    """The record fields ``template`` reads: ``"{x} or {c[0]}"`` → ``["x", "c"]``; a value
    without ``{`` is itself a field name."""
    if "{" not in template:
        return [template]
    names = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is not None:
            base = re.split(r"[.\[]", name, maxsplit=1)[0]
            if not base or base.isdigit():
                raise ValueError(f"template {template!r}: fields are named, e.g. {{x}}")
            names.append(base)
    return names


def render(template: str, record: Mapping[str, Any]) -> Any:
    """The template filled from ``record`` (a string), or the named field's value as it is."""
    if "{" not in template:
        return record[template]
    return template.format_map(record)


def check_fields(fields: Mapping[str, Any], task: str) -> dict[str, Any]:
    """``fields`` with the defaults filled in, checked for ``task`` (ValueError names the key)."""
    if task not in GENERIC_TASKS:
        raise ValueError(f"{task!r} is not one of the generic tasks {GENERIC_TASKS}")
    unknown = sorted(set(fields) - set(FIELD_KEYS))
    if unknown:
        raise ValueError(f"fields.{unknown[0]}: unknown; allowed: {', '.join(FIELD_KEYS)}")
    out = {"prompt": fields.get("prompt", DEFAULT_FIELDS["prompt"])}
    if "id" in fields:
        out["id"] = fields["id"]
    code_keys = sorted(set(fields) & set(CODE_KEYS))
    if task == "code_tests":
        for key in ("tests", "entry_point"):
            if key not in fields:
                raise ValueError(f"fields.{key}: the code_tests task needs it")
        other = sorted(set(fields) & {"target", "choices", "label", "delimiter"})
        if other:
            raise ValueError(f"fields.{other[0]}: not for code_tests (its tests decide)")
        out.update({k: fields[k] for k in code_keys})
        out["prompt_is_code"] = fields.get("prompt_is_code", True)
        if not isinstance(out["prompt_is_code"], bool):
            raise ValueError("fields.prompt_is_code: expected true or false")
    elif code_keys:
        raise ValueError(f"fields.{code_keys[0]}: only for the code_tests task")
    if task == "multiple_choice":
        out["choices"] = fields.get("choices", DEFAULT_FIELDS["choices"])
        if "target" in fields and "label" not in fields:
            out["target"] = fields["target"]
        else:
            out["label"] = fields.get("label", DEFAULT_FIELDS["label"])
        out["delimiter"] = fields.get("delimiter", " ")
        if not isinstance(out["delimiter"], str):
            raise ValueError("fields.delimiter: expected a string")
    elif task != "code_tests":
        out["target"] = fields.get("target", DEFAULT_FIELDS["target"])
        if "delimiter" in fields:
            raise ValueError("fields.delimiter: only for multiple_choice")
    if task == "regex":
        if not isinstance(fields.get("pattern"), str):
            raise ValueError("fields.pattern: the regex task needs a pattern (a string)")
        try:
            re.compile(fields["pattern"])
        except re.error as exc:
            raise ValueError(f"fields.pattern: not a regular expression: {exc}") from None
        out["pattern"] = fields["pattern"]
    elif "pattern" in fields:
        raise ValueError("fields.pattern: only for the regex task")
    for key in ("prompt", "target", "label", "id", "tests", "entry_point", "setup"):
        if key in out and not isinstance(out[key], str):
            raise ValueError(f"fields.{key}: expected a template or a field name (a string)")
    choices = out.get("choices")
    if choices is not None and not (
        isinstance(choices, str)
        or (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices))
    ):
        raise ValueError("fields.choices: a field name, or a list of templates")
    for key in ("prompt", "target", "label", "id", "choices", "tests", "entry_point", "setup"):
        for template in [out[key]] if isinstance(out.get(key), str) else out.get(key) or []:
            template_fields(template)  # malformed templates are refused before any record
    return out


def _record_choices(template: str | list[str], record: Mapping[str, Any]) -> list[str]:
    if isinstance(template, list):
        return [str(render(t, record)) for t in template]
    value = render(template, record)
    if isinstance(value, str):  # a CSV cell: a JSON list
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"fields.choices: {template!r} gives {value!r}, not a list of choices")
    return [str(c) for c in value]


def _record_label(value: Any, choices: list[str], key: str) -> int:
    if key == "label" and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)  # a CSV cell
    if isinstance(value, bool):
        raise ValueError(f"fields.{key}: {value!r} is not a choice index")
    if isinstance(value, int):
        if not 0 <= value < len(choices):
            raise ValueError(f"fields.{key}: index {value} but {len(choices)} choices")
        return value
    if str(value) in choices:
        return choices.index(str(value))
    raise ValueError(f"fields.{key}: {value!r} is neither a choice index nor one of {choices}")


def _record_tests(fields: Mapping[str, Any], record: Mapping[str, Any]) -> CodeTests:
    """A record's tests: ``tests`` gives a list of assert lines or one block of test code
    (run after ``setup`` and the solution); ``entry_point`` names the function."""
    tests = render(fields["tests"], record)
    if isinstance(tests, str):
        tests = [tests]
    if (
        not isinstance(tests, (list, tuple))
        or not tests
        or not all(isinstance(t, str) for t in tests)
    ):
        raise ValueError(f"fields.tests: {fields['tests']!r} gives {tests!r}, not test code")
    return CodeTests(
        entry_point=str(render(fields["entry_point"], record)),
        prompt_is_code=fields["prompt_is_code"],
        asserts=tuple(tests),
        setup=str(render(fields["setup"], record)) if "setup" in fields else "",
    )


def items_from_records(
    records: Sequence[tuple[int, Mapping[str, Any]]], task: str, fields: Mapping[str, Any], path
) -> list[Item]:
    """Items of ``task`` from numbered records (see the module docstring); a missing field or
    a bad value is a :class:`BenchmarkFormatError` starting ``file:line:``."""
    fields = check_fields(fields, task)
    items = []
    for lineno, rec in records:
        where = f"{path}:{lineno}"
        for key, template in fields.items():
            if key in ("pattern", "delimiter", "prompt_is_code"):
                continue
            for t in template if isinstance(template, list) else [template]:
                for name in template_fields(t):
                    if name not in rec:
                        raise BenchmarkFormatError(
                            f"{where}: field {name!r} (used by fields.{key}: {t!r}) is not in "
                            f"the record; it has {', '.join(map(str, rec)) or 'no fields'}"
                        )
        try:
            prompt = str(render(fields["prompt"], rec))
            item_id = str(render(fields["id"], rec)) if "id" in fields else str(lineno)
            meta: dict[str, Any] = {}
            tests = answer = None
            if task == "code_tests":
                tests = _record_tests(fields, rec)
            elif task == "multiple_choice":
                choices = _record_choices(fields["choices"], rec)
                key = "label" if "label" in fields else "target"
                label = _record_label(render(fields[key], rec), choices, key)
                meta = {"choices": choices, "label": label, "delimiter": fields["delimiter"]}
                answer = choices[label]
            else:
                answer = str(render(fields["target"], rec))
                if task == "regex":
                    meta = {"pattern": fields["pattern"]}
        except (ValueError, IndexError, KeyError, AttributeError) as exc:
            raise BenchmarkFormatError(f"{where}: {exc}") from None
        items.append(Item(item_id, prompt, answer=answer, tests=tests, meta=meta))
    return items


def load_generic(
    path: str | os.PathLike,
    limit: int | None = None,
    *,
    task: str,
    fields: Mapping[str, Any] | None = None,
    split: str | None = None,
    name: str | None = None,
) -> Benchmark:
    """A benchmark of generic ``task`` from the records of ``path`` (see the module docstring)."""
    if path is None:
        raise FileNotFoundError(f"task {task!r} reads your own file: pass path=...")
    records = list(read_table(path, split))
    items = items_from_records(records, task, fields or {}, path)
    ids = [it.item_id for it in items]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise BenchmarkFormatError(f"{path}: item id {dup!r} (fields.id) appears twice")
    bench = Benchmark(name or f"{task}-{Path(path).name}", task, items, source=os.fspath(path))
    return bench.head(limit)


# ---------------------------------------------------------------- scoring


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip() if text.strip() else ""


def exact_check(text, item, settings):
    got = _first_line(text)
    return got == item.answer.strip(), got


def normalized_check(text, item, settings):
    got = normalize_answer(_first_line(text))
    return got == normalize_answer(item.answer), got


def regex_check(text, item, settings):
    m = re.search(item.meta["pattern"], text)
    if m is None:
        return False, None
    got = (m.group(1) if m.re.groups else m.group(0)) or ""
    return got.strip() == item.answer.strip(), got.strip()


def score_multiple_choice(benchmark, samples, settings, *, sandbox=None, progress=False):
    """``acc`` (primary) and ``acc_norm`` from each sample's ``loglikelihoods``."""
    items, acc, acc_norm = [], [], []
    for it in benchmark.items:
        choices, label = it.meta["choices"], it.meta["label"]
        recs, hits, hits_norm = [], 0, 0
        for rec in samples[it.item_id]:
            lls = rec["loglikelihoods"]
            pred = max(range(len(lls)), key=lambda i: (lls[i], -i))  # first best, as argmax
            normed = [ll / max(1, len(c)) for ll, c in zip(lls, choices)]
            pred_norm = max(range(len(normed)), key=lambda i: (normed[i], -i))
            hits += pred == label
            hits_norm += pred_norm == label
            recs.append(
                {
                    "text": choices[pred],
                    "finish_reason": rec["finish_reason"],
                    "loglikelihoods": lls,
                    "extracted": choices[pred],
                    "correct": pred == label,
                }
            )
        n = len(recs)
        acc.append(hits / n)
        acc_norm.append(hits_norm / n)
        items.append(
            {
                "item_id": it.item_id,
                "reference": it.answer,
                "scores": {"acc": acc[-1], "acc_norm": acc_norm[-1]},
                "samples": recs,
            }
        )
    return TaskScores(items, {"acc": acc, "acc_norm": acc_norm}, "acc")


def generic_prompt(item: Item, config) -> str:
    """Few-shot examples (``prompt.exemplars``: dicts with ``prompt`` and ``target``, each
    followed by a blank line, as lm-eval's ``fewshot_delimiter``), then the item's prompt."""
    shots = (config.exemplars or ())[: config.n_shots or 0]
    delimiter = item.meta.get("delimiter", " ") if "choices" in item.meta else ""
    return "".join(f"{e['prompt']}{delimiter}{e['target']}\n\n" for e in shots) + item.prompt


def choice_continuations(item: Item) -> list[str]:
    """What the candidate scores after a multiple-choice prompt: delimiter + each choice."""
    return [item.meta["delimiter"] + c for c in item.meta["choices"]]


_SCORERS = {
    "exact_match": answer_scorer(exact_check),
    "normalized_match": answer_scorer(normalized_check),
    "regex": answer_scorer(regex_check),
    "multiple_choice": score_multiple_choice,
    "code_tests": score_code,
}
_DESCRIPTIONS = {
    "exact_match": "your file: the completion's first line equals the target",
    "normalized_match": "your file: first line equals the target after SQuAD normalisation",
    "regex": "your file: the pattern's first group in the completion equals the target",
    "multiple_choice": "your file: the most likely choice (log-likelihood) is the label",
    "code_tests": "your file: the completed code passes the record's tests (sandboxed)",
}


def generic_task(name: str) -> Task:
    """The :class:`Task` of generic task ``name`` (one of :data:`GENERIC_TASKS`)."""
    if name not in GENERIC_TASKS:
        raise ValueError(f"{name!r} is not one of the generic tasks {GENERIC_TASKS}")

    def load(path=None, limit=None, **options):
        return load_generic(path, limit, task=name, **options)

    if name == "code_tests":
        stops = code_stop_strings
    elif name == "regex":
        stops = lambda b: ()  # noqa: E731
    else:
        stops = lambda b: ("\n",)  # noqa: E731
    return Task(
        name=name,
        kind="code" if name == "code_tests" else "answer",
        load=load,
        build_prompt=generic_prompt,
        score=_SCORERS[name],
        stop_strings=stops,
        description=_DESCRIPTIONS[name],
        continuations=choice_continuations if name == "multiple_choice" else None,
    )


for _name in GENERIC_TASKS:
    register_task(generic_task(_name))
