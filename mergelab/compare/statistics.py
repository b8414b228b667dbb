"""The comparison's statistics, from :mod:`mergelab.eval.stats` (one implementation for the
toolkit: bootstrap intervals, paired comparisons and McNemar's test live there).

Per seed and benchmark (test split): each row's score with a percentile bootstrap CI over items;
every row against the best single expert (chosen on validation) and every pair of rows against
each other, paired on the same items: the mean difference with a paired bootstrap CI, and — when
every per-item outcome is 0/1 — the exact McNemar test, whose p-value is the one reported.

Every p-value also comes Holm-adjusted (``p_holm``, :func:`mergelab.eval.stats.holm`) over
its family: the rows against the best expert on one benchmark and seed, and all pairs of rows on
one benchmark and seed. A claim picked from a family is judged by ``p_holm``.

With several seeds, each row's per-seed scores and a seed-level interval: ``t`` — mean ± t(0.975,
n−1)·sd/√n over the seeds' scores (seeds are the unit; items are not pooled); ``percentile`` —
the percentile interval of the seeds' scores resampled with replacement. Differences to the best
expert get the same seed-level interval.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations
from typing import Any

import numpy as np

from mergelab.eval.stats import bootstrap_ci, holm, paired_comparison, t_interval

SEED_INTERVAL_KINDS = {
    "t": "Student-t interval over seeds: mean ± t(1−α/2, n−1)·sd/√n of the per-seed scores",
    "percentile": "percentile bootstrap interval of the per-seed scores (seeds resampled)",
}


HOLM = (
    "p_holm: Holm step-down over the family (rows vs the best expert; all pairs), per benchmark "
    "and seed"
)


def seed_interval(values: Sequence[float], kind: str, confidence: float, seed: int = 0) -> dict:
    a = np.asarray(values, dtype=np.float64)
    out: dict[str, Any] = {
        "values": [float(v) for v in a],
        "mean": float(a.mean()),
        "n_seeds": a.size,
        "kind": kind,
        "description": SEED_INTERVAL_KINDS[kind],
    }
    if a.size < 2:
        out.update(low=None, high=None)
        return out
    if kind == "t":
        low, high = t_interval(a, confidence)
        out.update(low=low, high=high)
    else:  # the seeds' scores resampled: the items' bootstrap, with seeds as the items
        ci = bootstrap_ci(a, 10_000, confidence, seed)
        out.update(low=ci["low"], high=ci["high"])
    return out


def per_seed_statistics(
    test: Mapping[str, Mapping[str, Mapping[str, float]]],
    best_expert: Mapping[str, str | None],
    n_boot: int,
    confidence: float,
    seed: int,
) -> dict[str, Any]:
    """``test[benchmark][row]`` = {item id: score}. Returns per benchmark: ``scores`` (row →
    bootstrap CI), ``vs_best_expert`` (row → paired comparison), ``pairwise`` ("a vs b" → paired
    comparison, a before b in row order), each with ``p_holm`` over its family; ``correction``."""
    out = {}
    for bench, rows in test.items():
        entry: dict[str, Any] = {
            "scores": {
                r: bootstrap_ci(list(v.values()), n_boot, confidence, seed) for r, v in rows.items()
            },
            "best_expert": best_expert.get(bench),
            "vs_best_expert": {},
            "pairwise": {},
        }
        ref = best_expert.get(bench)
        if ref is not None:
            for r, v in rows.items():
                if r != ref:
                    entry["vs_best_expert"][r] = paired_comparison(
                        v, rows[ref], n_boot, confidence, seed
                    )
        for a, b in combinations(rows, 2):
            entry["pairwise"][f"{a} vs {b}"] = paired_comparison(
                rows[a], rows[b], n_boot, confidence, seed
            )
        for family in ("vs_best_expert", "pairwise"):
            tests = entry[family]
            for key, p in holm({k: t["p_value"] for k, t in tests.items()}).items():
                tests[key]["p_holm"] = p
        entry["correction"] = HOLM
        out[bench] = entry
    return out


def across_seeds(per_seed: Mapping[int, Mapping[str, Any]], kind: str, confidence: float) -> dict:
    """Seed-level intervals of each row's score and of its difference to the best expert."""
    seeds = sorted(per_seed)
    out: dict[str, Any] = {"kind": kind, "description": SEED_INTERVAL_KINDS[kind], "benchmarks": {}}
    benches = per_seed[seeds[0]].keys()
    for bench in benches:
        rows = per_seed[seeds[0]][bench]["scores"].keys()
        scores = {
            r: seed_interval(
                [per_seed[s][bench]["scores"][r]["mean"] for s in seeds], kind, confidence
            )
            for r in rows
        }
        diffs = {}
        for r in rows:
            vals = [per_seed[s][bench]["vs_best_expert"].get(r) for s in seeds]
            if all(v is not None for v in vals):
                diffs[r] = seed_interval(
                    [v["paired_bootstrap"]["mean_diff"] for v in vals], kind, confidence
                )
        out["benchmarks"][bench] = {"scores": scores, "vs_best_expert": diffs}
    return out
