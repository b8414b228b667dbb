"""Evaluation tasks, registered by name like the merge methods: the one table that says, for
every benchmark, how it is loaded, prompted (with how many shots, from which exemplars) and
scored. A :class:`Benchmark` names its task.

    task = get_task("gsm8k")
    bench = task.load("data/gsm8k_test.jsonl")          # Benchmark(task="gsm8k", ...)
    bench = load_benchmark("humaneval+")                  # task "humaneval", variant "plus"

:func:`mergelab.eval.evaluate`, :func:`mergelab.eval.build_prompt` and the stop strings all go
through the benchmark's task, so adding a task is one file that calls :func:`register_task` —
in mergelab, or in a plugin (:mod:`mergelab.plugins`, docs/guides/plugins.md). mergelab's own are
registered when :mod:`mergelab.eval` is imported (which importing this module does first):

* ``mergelab.eval.standard_tasks`` — ``gsm8k``, ``math``, ``humaneval``, ``mbpp`` and ``code``
  (any in-memory benchmark of HumanEval/MBPP-style items);
* ``mergelab.eval.synthetic_tasks`` — ``synth_math``, ``synth_count``, ``synth_code``,
  ``synth_mixed``, ``synth_mixed_fresh`` (the mini LLM study's sets, scored strictly);
* ``mergelab.eval.letter_tasks`` — ``letter_map`` (the toy letter-replacement strings) and
  ``letter_skill`` (one skill's positions of them);
* ``mergelab.eval.generic_tasks`` — ``exact_match``, ``normalized_match``, ``regex``,
  ``multiple_choice`` and ``code_tests`` over your own file of records, with field templates;
* ``mergelab.eval.lm_eval_tasks`` — ``lm_eval``: an lm-evaluation-harness task, run by lm-eval.

A prompt builder is called as ``build_prompt(item, config)`` with ``config`` a
:class:`~mergelab.eval.PromptConfig` whose ``n_shots`` and ``exemplars`` are already the task's
defaults where the user gave none (:meth:`Task.prompt_config`): the shots are
``config.exemplars[:config.n_shots]``. A scorer is called as
``score(benchmark, samples, settings, sandbox=None, progress=False)`` with ``samples[item_id]``
the list of generation records (``text``, ``finish_reason``) of each item, and returns
:class:`TaskScores`.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mergelab.errors import UserInputError

if TYPE_CHECKING:
    from mergelab.eval.benchmarks import Benchmark, Item
    from mergelab.eval.harness import EvalSettings
    from mergelab.eval.prompts import PromptConfig

# "answer": a text compared with a reference ("math": the same, for numbers and expressions);
# "code": tests run in the sandbox, and chat models are asked for a fenced block.
KINDS = ("answer", "math", "code")


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
    """An evaluation task.

    ``kind``: one of :data:`KINDS`. ``load(path=None, limit=None, **variant)`` reads a benchmark;
    ``variants`` names keyword flags of ``load`` that select a variant of the benchmark
    (``"plus"``: ``humaneval_plus`` / ``humaneval+`` is ``load(path, plus=True)``); ``bundled``
    the benchmark names (the task's own or ``<task>_<variant>``) that load without a path.
    ``build_prompt(item, config)`` and ``score(...)``: see the module docstring. ``shots``: the
    protocol's default number of few-shot examples; ``exemplars()``: the pool they come from.
    ``stop_strings(benchmark)`` gives the default stop sequences of plain-text prompts.
    ``baselines`` maps a name to a function giving a trivial completion for an item (scored by
    ``score`` like a model's, e.g. a floor). ``continuations(item)``, when given, makes the task
    one of log-likelihoods: nothing is generated; the candidate scores each continuation after
    the prompt (:meth:`Candidate.score`) and the sample's record holds them as
    ``loglikelihoods`` (its ``text`` is the most likely continuation). ``run_items(candidate,
    items)``, when given, evaluates a split's items in one call outside mergelab's decoding loop
    (an lm-eval run) and returns item id → the sample's record (``text``, ``finish_reason``,
    ``n_tokens`` (generated), ``n_scored_tokens`` (scored, for log-likelihood requests),
    ``seconds``, ``forward_passes`` and whatever ``score`` reads)."""

    name: str
    kind: str
    load: Callable[..., Benchmark]
    build_prompt: Callable[[Item, PromptConfig], str]
    score: Callable[..., TaskScores]
    baselines: Mapping[str, Callable[[Item], str]] = field(default_factory=dict)
    stop_strings: Callable[[Benchmark], tuple[str, ...]] = lambda benchmark: ()
    description: str = ""
    shots: int = 0
    exemplars: Callable[[], Sequence[Mapping[str, str]]] | None = None
    variants: tuple[str, ...] = ()
    bundled: tuple[str, ...] = ()
    continuations: Callable[[Item], Sequence[str]] | None = None
    run_items: Callable[..., Mapping[str, Mapping[str, Any]]] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"task {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.shots and self.exemplars is None:
            raise ValueError(f"task {self.name!r}: {self.shots} shots but no exemplars")

    def prompt_config(self, config: PromptConfig) -> PromptConfig:
        """``config`` with the task's defaults where it gives none: ``n_shots`` (``shots``) and
        ``exemplars`` (the task's pool); more shots than exemplars is refused."""
        n = self.shots if config.n_shots is None else config.n_shots
        pool = config.exemplars
        if pool is None:
            pool = tuple(self.exemplars()) if self.exemplars is not None and n else ()
        if not 0 <= n <= len(pool):
            raise ValueError(
                f"{n}-shot prompt requested but task {self.name!r} has {len(pool)} exemplars"
            )
        return replace(config, n_shots=n, exemplars=tuple(pool))


_TASKS: dict[str, Task] = {}
_ORIGINS: dict[str, str] = {}  # name -> where it was registered from (mergelab.plugins.origin_of)


def register_task(task: Task) -> Task:
    """Add ``task`` to the registry (a name may be registered once); returns it."""
    from mergelab.plugins import origin_of

    caller = inspect.currentframe().f_back  # the module that registers the task
    origin = origin_of(caller.f_globals.get("__name__") if caller else None)
    if task.name in _TASKS and _TASKS[task.name] is not task:
        raise ValueError(
            f"task {task.name!r} ({origin}) is already registered "
            f"({_ORIGINS.get(task.name, 'unknown')})"
        )
    _TASKS[task.name] = task
    _ORIGINS.setdefault(task.name, origin)
    return task


def unregister_task(name: str) -> None:
    """Remove a task (tests; a plugin reloaded in the same process)."""
    _TASKS.pop(name, None)
    _ORIGINS.pop(name, None)


def get_task(name: str) -> Task:
    """The registered task ``name``; :class:`UnknownTaskError` (listing the known ones and where
    each came from) if none."""
    from mergelab.plugins import load_entry_points

    load_entry_points()
    try:
        return _TASKS[name]
    except (KeyError, TypeError):
        raise UnknownTaskError(
            f"unknown task {name!r}; known tasks: {list_tasks()} ({_described()})"
        ) from None


def list_tasks() -> list[str]:
    """Names of the registered tasks, sorted."""
    from mergelab.plugins import load_entry_points

    load_entry_points()
    return sorted(_TASKS)


def task_origins() -> dict[str, str]:
    """Every registered task's name → where it came from (see :mod:`mergelab.plugins`)."""
    return {name: _ORIGINS.get(name, "unknown") for name in list_tasks()}


def _described() -> str:
    from mergelab.plugins import describe_registered

    return describe_registered(task_origins())


def _split_name(name: str) -> tuple[Task, dict[str, bool]]:
    """The task and variant flags of a benchmark name: ``gsm8k``, ``humaneval+`` /
    ``humaneval_plus`` (task ``humaneval``, ``plus=True``)."""
    if not isinstance(name, str):
        raise UnknownTaskError(f"a benchmark name must be a string, got {name!r}")
    key = name.replace("+", "_plus").replace("-", "_")
    for task_name in list_tasks():
        task = _TASKS[task_name]
        if key == task_name:
            return task, {}
        for variant in task.variants:
            if key == f"{task_name}_{variant}":
                return task, {variant: True}
    lowered = key.lower()
    if lowered != key:
        return _split_name(lowered)
    raise UnknownTaskError(f"unknown benchmark {name!r}; known: {benchmark_names()}")


def benchmark_names() -> list[str]:
    """Every name :func:`load_benchmark` takes: each task's, and ``<task>_<variant>``."""
    names = []
    for task_name in list_tasks():
        names.append(task_name)
        names += [f"{task_name}_{v}" for v in _TASKS[task_name].variants]
    return sorted(names)


def canonical_benchmark_name(name: str) -> str:
    """``humaneval+`` → ``humaneval_plus``: the name :func:`benchmark_names` lists."""
    task, variant = _split_name(name)
    return "_".join([task.name, *variant])


def needs_path(name: str) -> bool:
    """Whether benchmark ``name`` must be given a local file (its task does not bundle it)."""
    task, _ = _split_name(name)
    return canonical_benchmark_name(name) not in task.bundled


def load_benchmark(
    name: str,
    path: str | os.PathLike | None = None,
    limit: int | None = None,
    options: Mapping[str, Any] | None = None,
) -> Benchmark:
    """Load benchmark ``name`` (a task's name, or ``<task>_<variant>`` / ``<task>+``) from
    ``path`` through its task's loader; ``options`` are more keyword arguments of the loader
    (the generic tasks' ``fields`` and ``split``)."""
    task, variant = _split_name(name)
    if path is None and needs_path(name):
        raise FileNotFoundError(f"benchmark {name!r} needs a local file: pass path=...")
    options = dict(options or {})
    params = inspect.signature(task.load).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = sorted(k for k in options if k not in params and not takes_any)
    if unknown:
        raise UnknownTaskError(f"benchmark {name!r} takes no option {unknown[0]!r}")
    if "limit" in params or takes_any:
        return task.load(path, limit=limit, **variant, **options)
    return task.load(path, **variant, **options).head(limit)


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
        raise ValueError(
            f"no completion for {len(missing)} item(s) of {benchmark.name!r}: {missing[:5]}"
        )
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
        raise UnknownTaskError(
            f"task {task.name!r} has no baseline {baseline!r}; it has {sorted(task.baselines)}"
        )
    fn = task.baselines[baseline]
    return {it.item_id: fn(it) for it in benchmark.items}
