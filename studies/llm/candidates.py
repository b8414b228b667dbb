"""The study's main table as a :func:`mergelab.compare.run` spec, and compare's results in the
form the study's results file keeps.

:func:`comparison_spec` writes the candidates — base, each expert, logit composition (w = 1),
weighted composition, task arithmetic, TIES, DARE-TIES, linear, and for LoRA experts the LoRA
composition and the adapter merge — and the benchmarks with their validation and test items as a
Python spec (the models are the setting's objects). ``mergelab.compare`` chooses every grid
point on validation (ties: the paper's default), picks each benchmark's best single expert on
validation, evaluates on test, scores the baselines and computes the statistics.
:func:`study_tables` turns its results into the results file's ``candidates``,
``choices``, ``paired_vs_best_expert`` and ``baselines`` (docs/compare.md has compare's schema).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mergelab.eval import Benchmark, EvalSettings
from mergelab.eval.sandbox import SandboxLimits

from .config import StudyConfig, study_device
from .setting import Setting

EXPERTS = {"math": "math_expert", "code": "code_expert"}  # skill → row (and expert) name
LORA_EXPERTS = {"math": "math_lora", "code": "code_lora"}
EVAL_FIELDS = ("n_samples", "pass_k", "gsm8k_extraction", "math_checker", "isolation", "workers")


def settings_spec(settings: EvalSettings) -> dict[str, Any]:
    """An :class:`EvalSettings` as a compare benchmark's ``generation``, ``prompt`` and ``eval``
    (its bootstrap settings and seed come from the spec's ``statistics`` and ``seeds``)."""
    if settings.sandbox != SandboxLimits():
        raise ValueError("compare specs take the default sandbox limits only")
    return {
        "generation": dataclasses.asdict(settings.generation),
        "prompt": dataclasses.asdict(settings.prompt),
        "eval": {k: getattr(settings, k) for k in EVAL_FIELDS},
    }


def benchmark_spec(
    name: str, test: Benchmark, validation: Benchmark | None, settings: EvalSettings, **extra
) -> dict[str, Any]:
    """One benchmark of the spec: its validation and test items as one :class:`Benchmark`,
    split by item id (the setting draws the splits; compare records them)."""
    val_items = validation.items if validation is not None else []
    both = Benchmark(name, test.task, [*val_items, *test.items], test.source)
    return {
        "name": name,
        "benchmark": both,
        "split": {
            "validation": [it.item_id for it in val_items] or None,
            "test": [it.item_id for it in test.items],
        },
        **settings_spec(settings),
        **extra,
    }


def comparison_spec(
    setting: Setting,
    cfg: StudyConfig,
    test: dict[str, Benchmark],
    fresh: dict[str, Benchmark],
    *,
    lora_expert_rows: bool,
) -> dict[str, Any]:
    """The main table as a compare spec. ``test``: benchmarks with a validation split in
    ``setting.validation`` (or one named by ``setting.validation_of``); ``fresh``: test only, its
    best expert chosen on the mixed validation split. ``lora_expert_rows``: each LoRA expert
    alone is also a row (it does not compete to be the best single expert)."""
    math, code = EXPERTS["math"], EXPERTS["code"]
    if setting.expert_dirs:  # the paper scale: folders, so weight merges stream from disk
        base: Any = str(setting.base_dir)
        experts: dict[str, Any] = {EXPERTS[s]: str(setting.expert_dirs[s]) for s in EXPERTS}
    else:
        base = setting.base
        experts = {EXPERTS[s]: setting.experts[s] for s in EXPERTS}
    pair = [math, code]
    candidates: list[dict[str, Any]] = [
        {"family": "base"},
        {"family": "expert", "experts": pair},
        {"family": "composition", "experts": pair},  # w = 1, the paper's rule
        {
            "family": "composition",
            "name": "composition_weighted",
            "experts": pair,
            "grid": {"weight": list(cfg.composition_weights)},
            "prefer": {"weight": 1.0},
        },
        {
            "family": "merge",
            "method": "task_arithmetic",
            "experts": pair,
            "grid": {"lambda": list(cfg.task_arithmetic_lambdas)},
            "prefer": {"lambda": 1.0},
        },
        {
            "family": "merge",
            "method": "ties",
            "experts": pair,
            "grid": {"lambda": list(cfg.ties_lambdas), "density": list(cfg.ties_densities)},
            "prefer": {"lambda": 1.0, "density": 0.2},
        },
        # DARE-TIES: λ on validation; its density is fixed (the random drop makes a density
        # grid mostly a seed lottery at this size).
        {
            "family": "merge",
            "method": "dare_ties",
            "experts": pair,
            "params": {"density": cfg.dare_density},
            "grid": {"lambda": list(cfg.dare_lambdas)},
            "prefer": {"lambda": 1.0},
        },
        {"family": "merge", "method": "linear", "experts": pair, "weights": [0.5, 0.5]},
    ]
    if setting.lora_adapters:
        lora = [LORA_EXPERTS[s] for s in ("math", "code")]
        experts.update(
            {LORA_EXPERTS[s]: {"adapter": str(setting.lora_adapters[s])} for s in ("math", "code")}
        )
        if lora_expert_rows:
            candidates.append(
                {"family": "expert", "name": "lora_experts", "experts": lora, "best_expert": False}
            )
        if cfg.lora_composition_row:
            candidates.append({"family": "lora_composition", "experts": lora})
        candidates.append(
            {
                "family": "lora_merge",
                "name": "lora_merge_task_arithmetic",
                "method": "task_arithmetic",
                "experts": lora,
                "params": {"lambda": 1.0},
            },
        )
    benchmarks = [
        benchmark_spec(
            name,
            bench,
            setting.validation.get(name),
            setting.eval_settings[name],
            validation_from=setting.validation_of.get(name),
        )
        for name, bench in test.items()
    ]
    benchmarks += [
        benchmark_spec(name, bench, None, setting.eval_settings[name], validation_from="mixed")
        for name, bench in fresh.items()
    ]
    return {
        "name": f"LLM study ({cfg.scale}, seed {cfg.seed})",
        "models": {"base": base, "tokenizer": setting.tokenizer, "experts": experts},
        "loading": {"device": str(study_device(cfg)), "dtype": cfg.dtype},
        "candidates": candidates,
        "benchmarks": benchmarks,
        "selection": {"metric": "mean", "tie_break": "closest"},
        "statistics": {"bootstrap_samples": cfg.bootstrap_samples},
        "seeds": [cfg.seed],
    }


def study_tables(results: dict[str, Any]) -> dict[str, Any]:
    """compare's results (one seed) as the study's results-file fields.

    ``candidates[row][benchmark]``: ``metric``, ``score`` (bootstrap CI), ``per_item`` (test
    outcomes), ``cost``, ``termination``; ``choices``: compare's ``families`` and
    ``best_expert`` of the seed; ``paired_vs_best_expert[benchmark]``: ``best_expert`` and
    ``vs[row]`` (paired bootstrap and exact McNemar); ``baselines[name][benchmark]``: ``score``
    and ``per_item``.
    """
    (seed,) = map(str, results["seeds"])
    stats = results["statistics"]["per_seed"][seed]
    candidates: dict[str, dict[str, Any]] = {r["row"]: {} for r in results["rows"]}
    for run in results["runs"]:
        if run["split"] == "test":
            candidates[run["row"]][run["benchmark"]] = {
                "metric": run["metric"],
                "score": stats[run["benchmark"]]["scores"][run["row"]],
                "per_item": run["items"],
                "cost": run["cost"],
                "termination": run["termination"],
                # per item: [generated tokens, finish reason] (records of older runs lack it)
                **({"per_item_stop": run["stops"]} if "stops" in run else {}),
            }
    paired = {
        b: {"best_expert": s["best_expert"], "vs": s["vs_best_expert"]}
        for b, s in stats.items()
        if s["best_expert"] is not None
    }
    floors: dict[str, dict[str, Any]] = {}
    for bench, per in results["baselines"][seed].items():
        for name, entry in per.items():
            floors.setdefault(name, {})[bench] = {
                "score": entry["score"]["mean"],
                "per_item": entry["items"],
            }
    return {
        "candidates": candidates,
        "choices": results["choices"][seed],
        "paired_vs_best_expert": paired,
        "baselines": floors,
    }
