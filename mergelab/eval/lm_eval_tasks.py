"""Any lm-evaluation-harness task as a mergelab benchmark (task ``lm_eval``), evaluated by
lm-eval itself — its prompts, few-shot examples, filters and metrics — on a candidate through
the bridge (:class:`mergelab.eval.lm_eval_bridge.MergelabLM`).

    bench = load_lm_eval_task({"task": "my_task", "include_path": "tasks/"})
    result = evaluate(candidate, bench.head(20), EvalSettings())   # per-doc metric per item

An item is one document of the task's evaluation split (``test_split``, else
``validation_split``): ``item_id`` is lm-eval's ``doc_id``, ``prompt`` its ``doc_to_text``,
``answer`` its ``doc_to_target`` (both shown, and fingerprinted, not used to score). A split of
items is evaluated in one lm-eval run restricted to those documents (``samples=``), with
``log_samples``: each item's score is lm-eval's per-document value of ``metric`` (default the
task's first metric), so compare's paired statistics (and McNemar, for 0/1 metrics such as
``acc`` or ``exact_match``) apply. Few-shot examples are drawn as lm-eval draws them (its
``fewshot_random_seed``, 1234) for the documents of the split, in order.

``include_path``: a folder of task YAMLs; with one, lm-eval's built-in tasks are not indexed
(``include_defaults: true`` adds them: slower, and their data comes from the Hugging Face Hub).
A task's ``dataset_kwargs.data_files`` relative paths are read from the working directory, as
lm-eval reads them: prefer absolute paths in your YAMLs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Mapping
from functools import cache
from typing import Any

from mergelab.errors import UserInputError
from mergelab.eval.benchmarks import Benchmark, Item
from mergelab.eval.tasks import Task, TaskScores, register_task

LM_EVAL_KEYS = ("task", "include_path", "include_defaults", "num_fewshot", "metric")


class LmEvalTaskError(UserInputError):
    """An lm-eval task that cannot be used (unknown, a group, an unknown metric)."""


def check_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``lm_eval`` settings with defaults, checked (ValueError names the key)."""
    unknown = sorted(set(config) - set(LM_EVAL_KEYS))
    if unknown:
        raise ValueError(f"lm_eval.{unknown[0]}: unknown; allowed: {', '.join(LM_EVAL_KEYS)}")
    if not isinstance(config.get("task"), str) or not config["task"]:
        raise ValueError("lm_eval.task: missing (the name of an lm-eval task)")
    out = {
        "task": config["task"],
        "include_path": config.get("include_path"),
        "include_defaults": config.get("include_defaults", config.get("include_path") is None),
        "num_fewshot": config.get("num_fewshot"),
        "metric": config.get("metric"),
    }
    if out["include_path"] is not None and not os.path.isdir(out["include_path"]):
        raise ValueError(f"lm_eval.include_path: {out['include_path']} is not a folder")
    if not isinstance(out["include_defaults"], bool):
        raise ValueError("lm_eval.include_defaults: expected true or false")
    n = out["num_fewshot"]
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"lm_eval.num_fewshot: expected an integer ≥ 0, got {n!r}")
    if out["metric"] is not None and not isinstance(out["metric"], str):
        raise ValueError("lm_eval.metric: expected a metric name")
    return out


@cache
def _task_manager(include_path: str | None, include_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def _lm_eval_task(config: Mapping[str, Any]):
    name = config["task"]
    manager = _task_manager(config["include_path"], config["include_defaults"])
    if name not in manager.all_tasks:
        where = config["include_path"] or "lm-eval's built-in tasks"
        raise LmEvalTaskError(f"lm_eval.task: no lm-eval task {name!r} in {where}")
    loaded = manager.load([name])
    if loaded["groups"] or list(loaded["tasks"]) != [name]:
        raise LmEvalTaskError(
            f"lm_eval.task: {name!r} is a group of lm-eval tasks "
            f"({', '.join(loaded['tasks'])}); name one of them"
        )
    return loaded["tasks"][name]


def load_lm_eval_task(
    config: Mapping[str, Any], limit: int | None = None, *, name: str | None = None
) -> Benchmark:
    """The documents of an lm-eval task's evaluation split as a benchmark of task ``lm_eval``."""
    config = check_config(config)
    task = _lm_eval_task(config)
    metrics = [m["metric"] for m in task.config.metric_list or ()]
    metric = config["metric"] or (metrics[0] if metrics else None)
    if metric not in metrics:
        raise LmEvalTaskError(
            f"lm_eval.metric: task {config['task']!r} reports {', '.join(metrics) or 'none'}"
            f"; {metric!r} is not one of them"
        )
    config = {**config, "metric": metric}
    items = [
        Item(
            str(doc_id),
            str(task.doc_to_text(doc)),
            answer=json.dumps(task.doc_to_target(doc), default=str),
            meta={"lm_eval": config},
        )
        for doc_id, doc in enumerate(task.eval_docs)
    ]
    bench = Benchmark(name or config["task"], "lm_eval", items, source=f"lm_eval:{config['task']}")
    return bench.head(limit)


def run_lm_eval(candidate, items: list[Item], progress: bool = True) -> dict[str, dict[str, Any]]:
    """One lm-eval run of ``candidate`` on ``items`` (documents of one task): item id → the
    cache record (``text``: lm-eval's filtered response; ``lm_eval_metrics``: the document's
    values of every metric; its cost as the bridge measured it: ``n_tokens`` generated,
    ``n_scored_tokens`` scored, ``seconds`` and ``forward_passes`` of the model).

    ``progress``: the bridge's request progress (:mod:`mergelab.progress`: tqdm's bars on a
    terminal, plain lines in a log); lm-eval's own bars only on a terminal."""
    import lm_eval

    from mergelab.eval.lm_eval_bridge import MergelabLM

    config = items[0].meta["lm_eval"]
    name = config["task"]
    # In ascending order: lm-eval walks the selected documents in the task's order and gives the
    # k-th the id samples[k] (and its requests the doc_id k), so any other order mislabels them.
    ids = sorted(int(it.item_id) for it in items)
    lm = MergelabLM(candidate, progress=progress)
    with _lm_eval_bars(shown=lm.terminal_bars()):
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=[name],
            task_manager=_task_manager(config["include_path"], config["include_defaults"]),
            num_fewshot=config["num_fewshot"],
            samples={name: ids},
            log_samples=True,
            bootstrap_iters=0,
            verbosity="ERROR",
        )
    metrics = [m["metric"] for m in _lm_eval_task(config).config.metric_list]
    usage = {ids[k]: used for (task, k), used in lm.usage.items() if task == name}
    out = {}
    for sample in results["samples"][name]:
        resp = sample["filtered_resps"]
        text = resp[0] if len(resp) == 1 and isinstance(resp[0], str) else json.dumps(resp)
        used = usage.get(sample["doc_id"], {})
        out[str(sample["doc_id"])] = {
            "text": text,
            "finish_reason": "lm_eval",
            "lm_eval_metrics": {m: float(sample[m]) for m in metrics if m in sample},
            "n_tokens": int(used.get("generated_tokens", 0)),
            "n_scored_tokens": int(used.get("scored_tokens", 0)),
            "seconds": float(used.get("seconds", 0.0)),
            "forward_passes": float(used.get("forward_calls", 0.0)),
        }
    missing = [it.item_id for it in items if it.item_id not in out]
    if missing:
        raise RuntimeError(f"lm-eval returned no sample for documents {missing[:5]} of {name!r}")
    return out


def score_lm_eval(benchmark, samples, settings, *, sandbox=None, progress=False) -> TaskScores:
    """Each item's values of the task's metrics, as lm-eval logged them; primary: ``metric``."""
    primary = benchmark.items[0].meta["lm_eval"]["metric"] if benchmark.items else "score"
    items, metrics = [], {}
    for it in benchmark.items:
        recs = samples[it.item_id]
        values: dict[str, float] = {}
        for m in recs[0]["lm_eval_metrics"]:
            values[m] = sum(r["lm_eval_metrics"][m] for r in recs) / len(recs)
            metrics.setdefault(m, []).append(values[m])
        items.append(
            {
                "item_id": it.item_id,
                "reference": it.answer,
                "scores": values,
                "samples": [{"text": r["text"], "finish_reason": r["finish_reason"]} for r in recs],
            }
        )
    extra = {"lm_eval": benchmark.items[0].meta["lm_eval"]} if benchmark.items else {}
    return TaskScores(items, metrics, primary, extra)


@contextlib.contextmanager
def _lm_eval_bars(shown: bool):
    """lm-eval's "Building contexts" bar (``lm_eval.api.task``'s module-level ``tqdm``, which
    takes no ``disable``) switched off where progress is not drawn as bars: in a log its
    carriage returns would arrive as one garbled line per job."""
    import lm_eval.api.task as task_module

    bar = getattr(task_module, "tqdm", None)
    if shown or bar is None:
        yield
        return
    task_module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        task_module.tqdm = bar


register_task(
    Task(
        name="lm_eval",
        kind="answer",
        load=lambda path=None, limit=None, **config: load_lm_eval_task(config, limit),
        build_prompt=lambda item, config: item.prompt,
        score=score_lm_eval,
        description="an lm-evaluation-harness task, run by lm-eval (its prompts and metrics)",
        run_items=run_lm_eval,
        bundled=("lm_eval",),
    )
)
