"""Evaluation harness: benchmarks, prompts, scoring, a sandbox for generated code, one
``evaluate()`` entry point with an on-disk resume cache, and bootstrap statistics.

The lm-evaluation-harness bridge (:mod:`mergelab.eval.lm_eval_bridge`, needs the ``lm_eval``
extra) and candidate spec files (:mod:`mergelab.eval.spec`) are imported from their modules.

Typical use::

    from mergelab.eval import EvalSettings, evaluate, load_benchmark
    result = evaluate(candidate, load_benchmark("humaneval"), EvalSettings())
    print(result.summary["metrics"])

A benchmark names its task (:mod:`mergelab.eval.tasks`: loader, prompt, shots, scorer,
baselines); adding a task is one file that calls :func:`register_task` (in a plugin:
docs/guides/plugins.md). mergelab's own tasks are registered at the end of this file.
"""

# The built-in tasks (importing a module registers its tasks).
from mergelab.eval import (  # noqa: E402, F401
    generic_tasks,
    letter_tasks,
    lm_eval_tasks,
    standard_tasks,
    synthetic_tasks,
)
from mergelab.eval.benchmarks import (
    Benchmark,
    BenchmarkFormatError,
    CodeTests,
    Item,
    load_gsm8k,
    load_humaneval,
    load_humaneval_plus,
    load_math,
    load_mbpp,
    load_mbpp_plus,
)
from mergelab.eval.harness import (
    EvalResult,
    EvalSettings,
    cache_key,
    evaluate,
    export_evalplus_samples,
    read_generations,
)
from mergelab.eval.prompts import PromptConfig, build_prompt, stop_strings
from mergelab.eval.sandbox import (
    ExecutionResult,
    Sandbox,
    SandboxLimits,
    SandboxUnavailableError,
    run_programs,
)
from mergelab.eval.scoring_code import pass_at_k, run_code_tests
from mergelab.eval.scoring_math import (
    MATH_CHECKERS,
    answer_scorer,
    extract_gsm8k,
    extract_math_answer,
    gsm8k_correct,
    math_answers_equal,
    math_correct,
    math_verify_correct,
    normalize_math_answer,
)
from mergelab.eval.stats import bootstrap_ci, compare, mcnemar_exact, paired_bootstrap
from mergelab.eval.tasks import (
    Task,
    TaskScores,
    get_task,
    list_tasks,
    load_benchmark,
    register_task,
    score_completions,
    task_origins,
)

__all__ = [
    "MATH_CHECKERS",
    "Benchmark",
    "BenchmarkFormatError",
    "CodeTests",
    "EvalResult",
    "EvalSettings",
    "ExecutionResult",
    "Item",
    "PromptConfig",
    "Sandbox",
    "SandboxLimits",
    "SandboxUnavailableError",
    "Task",
    "TaskScores",
    "answer_scorer",
    "bootstrap_ci",
    "build_prompt",
    "run_code_tests",
    "cache_key",
    "compare",
    "evaluate",
    "read_generations",
    "export_evalplus_samples",
    "extract_gsm8k",
    "extract_math_answer",
    "get_task",
    "gsm8k_correct",
    "list_tasks",
    "load_benchmark",
    "load_gsm8k",
    "load_humaneval",
    "load_humaneval_plus",
    "load_math",
    "load_mbpp",
    "load_mbpp_plus",
    "math_answers_equal",
    "math_correct",
    "math_verify_correct",
    "mcnemar_exact",
    "normalize_math_answer",
    "paired_bootstrap",
    "pass_at_k",
    "register_task",
    "run_programs",
    "score_completions",
    "stop_strings",
    "task_origins",
]
