"""``mergelab.compare.run(spec, out=...)``: the whole comparison, top to bottom.

1. Plan: load the benchmarks, resolve the splits of every seed (recorded), expand the grids.
2. Merges: stream every merge of checkpoint folders to ``<cache>/merges`` (once; cached).
3. Validation: the experts and every grid point of every tuned family on each validation split.
4. Choose, on validation only: each family's grid point, and per benchmark the best expert.
5. Test: the base, every expert and each family's chosen point on each test split; baselines.
6. Statistics, costs, ``results.json``, ``table.md`` and the figures (drawn from results.json).

Every step resumes: merges, generations (:mod:`mergelab.eval`'s cache) and finished jobs are
kept in the cache folder (default ``<out>.cache`` beside the output), and the output folder
appears only when complete (:mod:`mergelab.outputs`).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mergelab.compare.candidates import ModelStore
from mergelab.compare.executors import JobContext, progress_default, run_jobs
from mergelab.compare.plan import Plan, candidate_name, made_of, make_plan
from mergelab.compare.report import write_output
from mergelab.compare.results_file import RESULTS_SCHEMA, RESULTS_VERSION
from mergelab.compare.select import choose_best_expert, choose_point
from mergelab.compare.spec import (
    CompareSpec,
    SpecError,
    eval_settings_for,
    load_spec,
    with_executor,
    with_plugins,
)
from mergelab.compare.statistics import across_seeds, per_seed_statistics
from mergelab.eval.tasks import get_task, score_completions
from mergelab.progress import progress_bar

__all__ = ["RESULTS_SCHEMA", "RESULTS_VERSION", "default_cache_dir", "run"]


def default_cache_dir(out: str | os.PathLike) -> Path:
    out = Path(os.path.abspath(out))
    return out.parent / f"{out.name}.cache"


def _inputs(spec: CompareSpec, plan: Plan | None = None) -> list[str]:
    paths = [m.path for m in spec.models.values() if m.path]
    if isinstance(spec.tokenizer, str):
        paths.append(spec.tokenizer)
    for b in spec.benchmarks:
        paths += [b.load[k] for k in ("file", "path") if b.load.get(k)]
    return paths + [path for _, path in _include_paths(spec)]


def _include_paths(spec: CompareSpec) -> list[tuple[str, str]]:
    """(benchmark name, folder) of each lm-eval benchmark's ``include_path``."""
    return [
        (b.name, b.load["lm_eval"]["include_path"])
        for b in spec.benchmarks
        if "lm_eval" in b.load and b.load["lm_eval"].get("include_path")
    ]


def check_work_folders(
    spec: CompareSpec,
    out: str | os.PathLike | None,
    cache_dir: str | os.PathLike | None,
) -> None:
    """Refuse an output or cache folder that is, contains or sits inside an lm-eval benchmark's
    ``include_path`` (before any work, ``--dry-run`` included): lm-eval reads every YAML under
    that folder, and mergelab would write (and with ``--force`` replace) among the user's task
    files."""
    folders = [(w, f) for w, f in (("output", out), ("cache", cache_dir)) if f]
    for bench, include in _include_paths(spec):
        inc = Path(include).resolve()
        for what, folder in folders:
            f = Path(os.path.abspath(folder)).resolve()
            if f == inc or inc in f.parents or f in inc.parents:
                relation = "is" if f == inc else "contains" if f in inc.parents else "is inside"
                raise SpecError(
                    f"{spec.source}: benchmarks[{bench}].lm_eval.include_path: the {what} folder "
                    f"{f} {relation} the task folder {inc} (lm-eval reads every YAML under it); "
                    "choose an output and cache outside it"
                )


def run(
    spec: str | os.PathLike | Mapping[str, Any] | CompareSpec,
    out: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    executor: str | Mapping[str, Any] | None = None,
    force: bool = False,
    progress: bool | None = None,
    figures: bool = True,
    sandbox=None,
    plugins: Sequence[str] = (),
) -> dict[str, Any]:
    """Run a comparison; returns the results (the content of ``results.json``).

    ``spec``: a YAML/TOML file, a dict (models, tokenizers and benchmarks may be objects) or a
    :class:`CompareSpec`. ``out``: the output folder (results.json, table.md, figures/); refused
    if it exists unless ``force`` and it is a mergelab output. ``cache_dir``: merges, generations
    and finished jobs (default: the spec's ``cache_dir``, else ``<out>.cache``; required when
    ``out`` is None). ``executor``: "local", "ray" or a mapping like the spec's ``executor``
    (overrides the spec's). ``sandbox``: a running :class:`~mergelab.eval.Sandbox` to score code
    in (its worker processes are reused across jobs; local executor only), else one per job.
    ``plugins``: more plugins (:mod:`mergelab.plugins`) for every worker, beside the spec's;
    load them before ``spec`` is read when it names their methods or tasks.
    """
    from mergelab.outputs import check_output_path

    spec = with_plugins(load_spec(spec), plugins)
    if executor is not None:
        spec = with_executor(spec, executor)
    progress = progress_default() if progress is None else progress
    if cache_dir is None:
        cache_dir = spec.cache_dir or (default_cache_dir(out) if out is not None else None)
    if cache_dir is None:
        raise ValueError("give out= or cache_dir= (where merges and generations are kept)")
    cache_dir = Path(os.path.abspath(cache_dir))
    check_work_folders(spec, out, cache_dir)
    if out is not None:  # refused now, before any work
        check_output_path(out, force=force, inputs=[*_inputs(spec), cache_dir])
    t0, c0 = time.time(), time.process_time()
    plan = make_plan(spec)
    store = ModelStore(spec, cache_dir)
    ctx = JobContext(plan, store, cache_dir, progress, sandbox)
    cache_dir.mkdir(parents=True, exist_ok=True)

    runs: list[dict[str, Any]] = []
    choices: dict[str, Any] = {}
    tested: dict[int, dict[str, dict[str, dict[str, float]]]] = {}
    best: dict[int, dict[str, str | None]] = {}
    for seed in spec.seeds:
        _prepare_merges(
            plan,
            store,
            seed,
            [p for f in plan.tuned for p in plan.grid_points(f)] + plan.fixed_points,
            progress,
        )
        val_records = run_jobs(ctx, plan.validation_jobs(seed), f"validation (seed {seed})")
        chosen, seed_choices = choose(plan, val_records)
        test_records = run_jobs(ctx, plan.test_jobs(seed, chosen), f"test (seed {seed})")
        runs += val_records + test_records
        choices[str(seed)] = seed_choices
        best[seed] = {b: (c or {}).get("chosen") for b, c in seed_choices["best_expert"].items()}
        tested[seed] = {}
        for r in test_records:
            tested[seed].setdefault(r["benchmark"], {})[r["row"]] = r["items"]
    store.release()

    baselines = {str(s): score_baselines(plan, s, sandbox) for s in spec.seeds}
    per_seed = {
        s: per_seed_statistics(tested[s], best[s], spec.bootstrap_samples, spec.confidence, s)
        for s in spec.seeds
    }
    for s in spec.seeds:  # baselines get a score CI beside the rows (no pairing)
        for bench, entries in baselines[str(s)].items():
            per_seed[s][bench]["baselines"] = {n: e["score"] for n, e in entries.items()}
    results = {
        "schema": RESULTS_SCHEMA,
        "schema_version": RESULTS_VERSION,
        "name": spec.name,
        "created_unix": time.time(),
        "runtime_seconds": time.time() - t0,
        "cpu_seconds": time.process_time() - c0,  # this process only (not Ray workers)
        "versions": package_versions(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "executor": spec.executor,
        "spec": spec.raw,
        "spec_source": spec.source,
        "plugins": list(spec.plugins),  # as every job loaded them (mergelab.plugins)
        "seeds": list(spec.seeds),
        "rows": [
            _row_info(p, spec.models)
            for p in plan.test_jobs(spec.seeds[0], _first_points(plan))
            if p.benchmark == spec.benchmarks[0].name
        ],
        "benchmarks": {
            b.name: {
                "task": plan.benchmarks[b.name].task,
                "source": plan.benchmarks[b.name].source,
                "validation_from": b.validation_from,
            }
            for b in spec.benchmarks
        },
        "splits": {str(s): plan.splits[s] for s in spec.seeds},
        "choices": choices,
        "runs": runs,
        "baselines": baselines,
        "statistics": {
            "per_seed": {str(s): v for s, v in per_seed.items()},
            "across_seeds": across_seeds(per_seed, spec.seed_interval, spec.confidence)
            if len(spec.seeds) > 1
            else None,
            "bootstrap_samples": spec.bootstrap_samples,
            "confidence": spec.confidence,
        },
        "costs": costs(runs),
    }
    if out is not None:
        write_output(results, out, force=force, figures=figures, inputs=[*_inputs(spec), cache_dir])
    return results


def _first_points(plan: Plan):
    return {f.name: plan.grid_points(f)[0] for f in plan.tuned}


def _row_info(job, models) -> dict[str, Any]:
    fam = job.point.family
    return {
        "row": job.point.row,
        "family": fam.family,
        "method": fam.method,
        "experts": list(fam.experts) if fam.family != "expert" else [job.point.expert],
        "grid": {k: list(v) for k, v in fam.grid.items()},
        "made_of": made_of(fam, models, job.point.expert),
    }


def _prepare_merges(plan: Plan, store: ModelStore, seed: int, points, progress: bool) -> None:
    todo = [p for p in points if store.streams_merge(p)]
    for p in progress_bar(todo, desc=f"merges (seed {seed})", enabled=progress and bool(todo)):
        store.ensure_merge(p, seed, progress=False)


def choose(plan: Plan, val_records: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each tuned family's grid point and each benchmark's best expert, from validation only."""
    spec = plan.spec
    vbenches = plan.validation_benchmarks
    metric = spec.selection_metric
    if metric != "mean" and metric not in vbenches:
        metric = spec.benchmark(metric).validation_from
    chosen, out = {}, {"families": {}, "best_expert": {}}
    for fam in plan.tuned:
        pts = plan.grid_points(fam)
        names = {p.candidate_name for p in pts}
        recs = [r for r in val_records if candidate_name(r["row"], r["label"]) in names]
        c = choose_point(pts, recs, metric, vbenches, spec.tie_break)
        chosen[fam.name] = c.pop("_point")
        out["families"][fam.name] = c
    experts = plan.expert_points
    erecs = [r for r in val_records if r["family"] == "expert"]
    for b in spec.benchmarks:
        vb = b.name if b.has_validation else b.validation_from
        out["best_expert"][b.name] = choose_best_expert(experts, erecs, b.name, vb, vbenches)
    return chosen, out


def score_baselines(plan: Plan, seed: int, sandbox=None) -> dict[str, Any]:
    """Each benchmark's baselines on its test split: the floor beside the candidates."""
    from mergelab.eval.stats import bootstrap_ci

    spec = plan.spec
    out: dict[str, Any] = {}
    for b in spec.benchmarks:
        bench = plan.split_benchmark(seed, b.name, "test")
        fns = baseline_functions(b, bench.task, spec.source)
        if not fns:
            continue
        settings = eval_settings_for(
            b.generation,
            b.prompt,
            b.eval,
            seed=seed,
            bootstrap_samples=spec.bootstrap_samples,
            confidence=spec.confidence,
        )
        out[b.name] = {}
        for name, fn in fns.items():
            completions = {it.item_id: fn(it) for it in bench.items}
            ok = score_completions(bench, completions, settings, sandbox=sandbox)
            items = {i: float(bool(ok[i])) for i in completions}
            out[b.name][name] = {
                "items": items,
                "score": bootstrap_ci(
                    list(items.values()), spec.bootstrap_samples, spec.confidence, seed
                ),
            }
    return out


def baseline_functions(b, task: str, source: str) -> dict[str, Any]:
    """The baselines of a benchmark: the spec's functions, or names the task declares (all of
    them when the spec names none)."""
    if isinstance(b.baselines, Mapping):
        return dict(b.baselines)
    try:
        declared = get_task(task).baselines
    except (KeyError, ValueError):  # a task without a registry entry
        declared = {}
    if b.baselines is None:
        return dict(declared)
    missing = [n for n in b.baselines if n not in declared]
    if missing:
        from mergelab.compare.spec import SpecError

        raise SpecError(
            f"{source}: benchmarks[{b.name}].baselines: task {task!r} declares no "
            f"baseline {missing[0]!r} (it declares: {', '.join(declared) or 'none'})"
        )
    return {n: declared[n] for n in b.baselines}


def costs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per row and benchmark: cost averaged over its test jobs (all seeds)."""
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        if r["split"] != "test":
            continue
        out.setdefault(r["row"], {}).setdefault(r["benchmark"], []).append(r["cost"])
    for benches in out.values():
        for b, cs in benches.items():
            benches[b] = {k: _mean_of([c.get(k) for c in cs]) for k in cs[0]}
    return out


def _mean_of(values: list[Any]) -> Any:
    """The mean of numbers (None if one is unknown); a label shared by all (else "mixed")."""
    if any(isinstance(v, str) for v in values):
        return values[0] if len(set(values)) == 1 else "mixed"
    if any(v is None for v in values):
        return None
    return sum(values) / len(values)


def package_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in (
        "mergelab",
        "torch",
        "transformers",
        "peft",
        "accelerate",
        "numpy",
        "scipy",
        "math-verify",
        "ray",
    ):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out
