"""Choosing on validation: which grid point of each family goes to test, and which single expert
is the reference of the paired comparisons. These functions receive validation records only —
they have no way to see a test item.

Metric: ``"mean"`` — the mean over the benchmarks with a validation split of each one's primary
metric (each benchmark weighs the same, whatever its size) — or one benchmark's name.
Ties (equal scores) go, by ``tie_break``: ``first`` — the earliest grid point in the order the
grid is written (the last parameter varying fastest); ``last`` — the latest; ``closest`` — the
point nearest the family's ``prefer`` (sum of absolute differences of numeric parameters, 1 for
each differing non-numeric one), then the earliest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mergelab.compare.plan import Point, candidate_name


def _validation_means(records: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], float]:
    """(candidate name, benchmark) → mean validation score, from validation records only."""
    out = {}
    for r in records:
        if r["split"] != "validation":
            raise ValueError("selection was given a record that is not from a validation split")
        out[(candidate_name(r["row"], r["label"]), r["benchmark"])] = r["mean"]
    return out


def selection_score(
    per_bench: Mapping[str, float], metric: str, benchmarks: Sequence[str]
) -> float:
    if metric == "mean":
        return sum(per_bench[b] for b in benchmarks) / len(benchmarks)
    return per_bench[metric]


def _distance(params: Mapping[str, Any], prefer: Mapping[str, Any]) -> float:
    d = 0.0
    for k, want in prefer.items():
        have = params.get(k)
        if isinstance(have, (int, float)) and isinstance(want, (int, float)):
            d += abs(float(have) - float(want))
        else:
            d += float(have != want)
    return d


def choose_point(
    points: Sequence[Point],
    records: Sequence[Mapping[str, Any]],
    metric: str,
    benchmarks: Sequence[str],
    tie_break: str,
) -> dict[str, Any]:
    """The chosen grid point of one family, every validation score, and the rule that chose."""
    means = _validation_means(records)
    per_point = {p.label: {b: means[(p.candidate_name, b)] for b in benchmarks} for p in points}
    scores = {label: selection_score(v, metric, benchmarks) for label, v in per_point.items()}
    best = max(scores.values())
    tied = [p for p in points if scores[p.label] == best]
    if tie_break == "last":
        chosen = tied[-1]
    elif tie_break == "closest":
        prefer = points[0].family.prefer or {}
        chosen = min(tied, key=lambda p: _distance(p.params, prefer))  # min keeps the earliest
    else:
        chosen = tied[0]
    return {
        "chosen": chosen.label,
        "params": chosen.params,
        "metric": metric,
        "validation_benchmarks": list(benchmarks),
        "tie_break": tie_break,
        "tied": [p.label for p in tied],
        "validation": scores,
        "validation_per_benchmark": per_point,
        "_point": chosen,
    }


def choose_best_expert(
    experts: Sequence[Point],
    records: Sequence[Mapping[str, Any]],
    test_benchmark: str,
    validation_benchmark: str | None,
    benchmarks: Sequence[str],
) -> dict[str, Any] | None:
    """The single expert best on ``validation_benchmark`` (the test benchmark's own validation
    split, or the one it names in ``validation_from``). Ties go to the higher mean over all
    validation benchmarks, then to the expert listed first. None without a validation split."""
    if validation_benchmark is None or not experts:
        return None
    means = _validation_means(records)
    scores = {p.row: means[(p.candidate_name, validation_benchmark)] for p in experts}
    overall = {
        p.row: sum(means[(p.candidate_name, b)] for b in benchmarks) / len(benchmarks)
        for p in experts
    }
    order = {p.row: i for i, p in enumerate(experts)}
    chosen = max(scores, key=lambda e: (scores[e], overall[e], -order[e]))
    return {
        "chosen": chosen,
        "validation_benchmark": validation_benchmark,
        "validation": scores,
        "mean_validation": overall,
        "tie_break": "higher mean over validation benchmarks, then the expert listed first",
    }
