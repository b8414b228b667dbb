"""Evaluation tasks, registered by name like the merge methods: a task is a loader, a prompt
builder and a scorer (plus optional trivial baselines), and a :class:`Benchmark` names its task.

    task = get_task("gsm8k")
    bench = task.load("data/gsm8k_test.jsonl")          # Benchmark(task="gsm8k", ...)
    prompt = task.build_prompt(bench.items[0], PromptConfig())

:func:`mergelab.eval.evaluate`, :func:`mergelab.eval.build_prompt` and the stop strings all go
through the benchmark's task, so adding a task is one file that calls :func:`register_task`
(and, for a task shipped with mergelab, one line in :data:`BUILTIN_TASK_MODULES`):

* ``mergelab.eval.standard_tasks`` — ``gsm8k``, ``math``, ``humaneval``, ``mbpp`` and ``code``
  (any in-memory benchmark of HumanEval/MBPP-style items);
* ``mergelab.eval.synthetic_tasks`` — ``synth_math``, ``synth_count``, ``synth_code``,
  ``synth_mixed``, ``synth_mixed_fresh`` (the mini LLM study's sets, scored strictly);
* ``mergelab.eval.letter_tasks`` — ``letter_map`` (the toy letter-replacement strings) and
  ``letter_skill`` (one skill's positions of them).

A scorer is called as ``score(benchmark, samples, settings, sandbox=None, progress=False)`` with
``samples[item_id]`` the list of generation records (``text``, ``finish_reason``) of each item,
and returns :class:`TaskScores`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mergelab.errors import UserInputError

if TYPE_CHECKING:
    from mergelab.eval.benchmarks import Benchmark, Item
    from mergelab.eval.harness import EvalSettings
    from mergelab.eval.prompts import PromptConfig

KINDS = ("math", "code")
BUILTIN_TASK_MODULES = (
    "mergelab.eval.standard_tasks",
    "mergelab.eval.synthetic_tasks",
    "mergelab.eval.letter_tasks",
)


class UnknownTaskError(UserInputError, KeyError):
    """A task name no module has registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class TaskScores:
    """What a scorer returns. ``items``: one dict per item (``item_id``, ``scores`` = the item's
    value of each metric, ``samples``); ``metrics``: metric → per-item values (item order);
    ``primary``: the headline metric; ``extra``: more summary entries (checker versions, ...)."""

    items: list[dict[str, Any]]
    metrics: dict[str, list[float]]
    primary: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    """``kind`` is "math" (an answer is extracted and compared) or "code" (tests are run in the
    sandbox; chat models are asked for a fenced block). ``stop_strings(benchmark)`` gives the
    default stop sequences of plain-text prompts. ``baselines`` maps a name to a function giving
    a trivial completion for an item (scored by ``score`` like a model's, e.g. a floor)."""

    name: str
    kind: str
    load: Callable[..., Benchmark]
    build_prompt: Callable[[Item, PromptConfig], str]
    score: Callable[..., TaskScores]
    baselines: Mapping[str, Callable[[Item], str]] = field(default_factory=dict)
    stop_strings: Callable[[Benchmark], tuple[str, ...]] = lambda benchmark: ()
    description: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"task {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")


_TASKS: dict[str, Task] = {}
_builtins_loaded = False


def register_task(task: Task) -> Task:
    """Add ``task`` to the registry (a name may be registered once); returns it."""
    if task.name in _TASKS and _TASKS[task.name] is not task:
        raise ValueError(f"task {task.name!r} is already registered")
    _TASKS[task.name] = task
    return task


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in BUILTIN_TASK_MODULES:
            importlib.import_module(module)


def get_task(name: str) -> Task:
    """The registered task ``name``; :class:`UnknownTaskError` (listing the known ones) if none."""
    _load_builtins()
    try:
        return _TASKS[name]
    except (KeyError, TypeError):
        raise UnknownTaskError(f"unknown task {name!r}; known tasks: {list_tasks()}") from None


def list_tasks() -> list[str]:
    """Names of the registered tasks, sorted."""
    _load_builtins()
    return sorted(_TASKS)


def score_completions(
    benchmark: Benchmark,
    completions: Mapping[str, str],
    settings: EvalSettings,
    *,
    sandbox: Any = None,
) -> dict[str, bool]:
    """``item_id`` → whether ``completions[item_id]`` is correct, scored by the benchmark's task
    exactly as a model's generation would be (one sample per item; no model involved).

    Every item of ``benchmark`` needs a completion. Used to report trivial baselines.
    """
    missing = [it.item_id for it in benchmark.items if it.item_id not in completions]
    if missing:
        raise ValueError(f"no completion for {len(missing)} item(s) of {benchmark.name!r}: "
                         f"{missing[:5]}")  # fmt: skip
    extra = sorted(set(completions) - {it.item_id for it in benchmark.items})
    if extra:
        raise ValueError(f"completions for items not in {benchmark.name!r}: {extra[:5]}")
    task = get_task(benchmark.task)
    one = replace(settings, n_samples=1, pass_k=(1,))
    samples = {
        it.item_id: [{"text": completions[it.item_id], "finish_reason": "given"}]
        for it in benchmark.items
    }
    scores = task.score(benchmark, samples, one, sandbox=sandbox, progress=False)
    return {it["item_id"]: it["scores"][scores.primary] == 1.0 for it in scores.items}


def baseline_completions(benchmark: Benchmark, baseline: str) -> dict[str, str]:
    """The completions of the task's trivial ``baseline`` for every item of ``benchmark``."""
    task = get_task(benchmark.task)
    if baseline not in task.baselines:
        raise UnknownTaskError(f"task {task.name!r} has no baseline {baseline!r}; it has "
                               f"{sorted(task.baselines)}")  # fmt: skip
    fn = task.baselines[baseline]
    return {it.item_id: fn(it) for it in benchmark.items}
