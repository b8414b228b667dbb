"""Several seeds of the LLM study side by side: per-seed values and their spread.

    python -m studies.llm.seeds results/llm/mini_seed0 results/llm/mini_seed1 \\
        results/llm/mini_seed2 --out results/llm/mini_seeds

Reads each run's ``results.json`` (nothing is recomputed) and writes ``<out>/summary.json`` and
``<out>/summary.md``: for every candidate and benchmark the test score of each seed, their mean,
sample standard deviation and range (min–max over seeds: with three seeds, the range is the
honest statement of spread, not an interval); the same for the trivial baselines, the 2-vs-3
experts termination measures and the remedies; and each seed's exact McNemar p-value of every
candidate against that seed's best single expert, and of the composition against the weight
merges head to head.

Every p-value also comes Holm-adjusted over the family a claim would be picked from
(``corrections`` names each family; :func:`mergelab.eval.stats.holm`): every row × seed against
the best expert on one benchmark; every head-to-head pair × benchmark × seed; every remedy ×
benchmark × seed against the plain composition. The families span the seeds, so "significant at
one seed" is judged among all the seeds' tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from mergelab.eval.stats import holm, mcnemar_exact
from mergelab.outputs import atomic_output_file
from mergelab.results import json_with_keys, starts_with, write_json_atomic


def spread(values: list[float | None]) -> dict[str, Any]:
    """Per-seed values, mean, sample sd (None with one seed) and range, ignoring missing ones."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"per_seed": values, "mean": None, "sd": None, "min": None, "max": None}
    return {
        "per_seed": values,
        "mean": statistics.fmean(vals),
        "sd": statistics.stdev(vals) if len(vals) > 1 else None,
        "min": min(vals),
        "max": max(vals),
    }


def summarise(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``runs``: label → results.json content. Candidates and benchmarks of the first run."""
    first = next(iter(runs.values()))
    out: dict[str, Any] = {
        "runs": list(runs),
        "seeds": [r["config"]["seed"] for r in runs.values()],
    }
    table = first["candidates"]
    benches = list(next(iter(table.values())))
    out["scores"] = {
        c: {
            b: spread(
                [
                    r["candidates"].get(c, {}).get(b, {}).get("score", {}).get("mean")
                    for r in runs.values()
                ]
            )
            for b in benches
        }
        for c in table
    }
    out["mcnemar_vs_best_expert"] = {
        b: {
            c: [
                _get(r, "paired_vs_best_expert", b, "vs", c, "mcnemar", "p_value")
                for r in runs.values()
            ]
            for c in table
        }
        for b in benches
    }
    out["best_expert"] = {
        b: [_get(r, "choices", "best_expert", b, "chosen") for r in runs.values()] for b in benches
    }
    floors = first.get("baselines") or {}
    out["baselines"] = {
        name: {
            b: spread([_get(r, "baselines", name, b, "score") for r in runs.values()]) for b in per
        }
        for name, per in floors.items()
    }
    rows = (first.get("termination") or {}).get("rows", [])
    out["termination"] = {}
    for i, row in enumerate(rows):
        key = f"{row['n_experts']}_experts/{row['eos_policy']}"
        out["termination"][key] = {
            b: {
                m: spread(
                    [
                        _get(r, "termination", "rows", i, "benchmarks", b, *path)
                        for r in runs.values()
                    ]
                )
                for m, path in TERMINATION_MEASURES.items()
            }
            for b in row["benchmarks"]
        }
    rem = (first.get("remedies") or {}).get("rows", {})
    out["remedies"] = {
        label: {
            "chosen": [
                (
                    _get(r, "remedies", "rows", label, "weight"),
                    _get(r, "remedies", "rows", label, "eos_policy"),
                )
                for r in runs.values()
            ],
            "scores": {
                b: spread(
                    [
                        _get(r, "remedies", "rows", label, "benchmarks", b, "score", "mean")
                        for r in runs.values()
                    ]
                )
                for b in row["benchmarks"]
            },
            "mcnemar_vs_plain": {
                b: [
                    _get(r, "remedies", "rows", label, "vs_plain", b, "mcnemar", "p_value")
                    for r in runs.values()
                ]
                for b in row["benchmarks"]
            },
        }
        for label, row in rem.items()
    }
    out["pairs"] = {
        f"{a} vs {b}": {
            bench: [_mcnemar(r, a, b, bench) for r in runs.values()] for bench in benches
        }
        for a, b in PAIRS
        if a in table and b in table
    }
    _add_holm(out)
    out["runtime_seconds"] = {
        k: [_get(r, "runtime_seconds", k) for r in runs.values()]
        for k in first.get("runtime_seconds", {})
    }
    return out


# The families the Holm-adjusted p-values are computed over (summary["corrections"]).
CORRECTIONS = {
    "holm_vs_best_expert": "Holm over every row × seed against that seed's best single expert "
    "on one benchmark (exact McNemar)",
    "pairs.p_holm": "Holm over every head-to-head pair × benchmark × seed (exact McNemar)",
    "remedies.holm_vs_plain": "Holm over every remedy × benchmark × seed against the plain "
    "3-expert composition (exact McNemar)",
}


def holm_lists(family: dict[Any, list[float | None]]) -> dict[Any, list[float | None]]:
    """Holm over every p-value of ``family`` (key → one p per seed; None: no test), in the same
    shape."""
    flat = {(k, i): p for k, ps in family.items() for i, p in enumerate(ps) if p is not None}
    adj = holm(flat) if flat else {}
    return {k: [adj.get((k, i)) for i in range(len(ps))] for k, ps in family.items()}


def _add_holm(out: dict[str, Any]) -> None:
    """Holm-adjusted p-values beside the raw ones, one family per block (:data:`CORRECTIONS`)."""
    out["holm_vs_best_expert"] = {
        b: holm_lists(per) for b, per in out["mcnemar_vs_best_expert"].items()
    }
    pairs = {
        (pair, b): [t["p_value"] if t else None for t in tests]
        for pair, per in out["pairs"].items()
        for b, tests in per.items()
    }
    for (pair, b), adjusted in holm_lists(pairs).items():
        for t, p in zip(out["pairs"][pair][b], adjusted):
            if t is not None:
                t["p_holm"] = p
    remedies = holm_lists(
        {
            (label, b): ps
            for label, row in out["remedies"].items()
            for b, ps in row["mcnemar_vs_plain"].items()
        }
    )
    for label, row in out["remedies"].items():
        row["holm_vs_plain"] = {b: remedies[(label, b)] for b in row["mcnemar_vs_plain"]}
    out["corrections"] = CORRECTIONS


TERMINATION_MEASURES = {
    "score": ("score", "mean"),
    "mean_generated_tokens": ("premature", "mean_generated_tokens"),
    "mean_length_ratio": ("premature", "mean_length_ratio"),
    "shorter_than_reference": ("premature", "shorter_than_reference"),
    "ends_right_after_marker": ("premature", "ends_right_after_marker"),
    "p_eos_inside_reference": ("eos_prob", "inside_reference"),
    "p_eos_at_reference_end": ("eos_prob", "at_reference_end"),
    "eos_argmax_inside_share": ("eos_prob", "eos_argmax_inside_share"),
}


# Head-to-head comparisons between families (each run's chosen grid points), exact McNemar.
PAIRS = [
    ("composition", "task_arithmetic"),
    ("composition_weighted", "task_arithmetic"),
    ("composition", "ties"),
    ("lora_composition", "lora_merge_task_arithmetic"),
]


def _mcnemar(run: dict[str, Any], a: str, b: str, bench: str) -> dict[str, Any] | None:
    """Exact McNemar test of candidate ``a`` vs ``b`` on their shared test items."""
    pa = _get(run, "candidates", a, bench, "per_item")
    pb = _get(run, "candidates", b, bench, "per_item")
    if pa is None or pb is None:
        return None
    shared = [i for i in pa if i in pb]
    if not shared or any(pa[i] not in (0.0, 1.0) or pb[i] not in (0.0, 1.0) for i in shared):
        return None
    test = mcnemar_exact([pa[i] == 1.0 for i in shared], [pb[i] == 1.0 for i in shared])
    n = len(shared)
    return {
        "n": n,
        "score_a": sum(pa[i] for i in shared) / n,
        "score_b": sum(pb[i] for i in shared) / n,
        **test,
    }


def _get(obj: Any, *path: Any) -> Any:
    for key in path:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def markdown(summary: dict[str, Any]) -> str:
    """Score per candidate and benchmark: mean [min–max] over seeds, and the per-seed values."""
    seeds = ", ".join(map(str, summary["seeds"]))
    benches = list(next(iter(summary["scores"].values())))
    lines = [
        f"Test score (%), mean [min–max] over seeds {seeds}; per-seed values in summary.json.",
        "",
        "| candidate | " + " | ".join(benches) + " |",
        "|---" * (len(benches) + 1) + "|",
    ]

    def cell(s: dict[str, Any]) -> str:
        if s["mean"] is None:
            return "–"
        return f"{100 * s['mean']:.1f} [{100 * s['min']:.1f}–{100 * s['max']:.1f}]"

    for c, per in summary["scores"].items():
        lines.append(f"| {c} | " + " | ".join(cell(per[b]) for b in benches) + " |")
    for name, per in summary["baselines"].items():
        lines.append(
            f"| *baseline: {name}* | "
            + " | ".join(cell(per[b]) if b in per else "–" for b in benches)
            + " |"
        )
    lines += ["", *tests_markdown(summary)]
    lines += ["", *termination_markdown(summary), "", *remedies_markdown(summary)]
    return "\n".join(lines)


def _ps(raw: list[float | None], adjusted: list[float | None]) -> str:
    """Per-seed "raw (Holm)" p-values, "–" for a seed without the test."""
    return " / ".join(
        "–" if p is None else f"{p:.2g}" + ("" if q is None else f" ({q:.2g})")
        for p, q in zip(raw, adjusted, strict=True)
    )


def tests_markdown(summary: dict[str, Any]) -> list[str]:
    """Per-seed exact McNemar p-values with their Holm-adjusted values, each family named."""
    vs, adj = summary["mcnemar_vs_best_expert"], summary.get("holm_vs_best_expert")
    if adj is None:  # a summary written before the corrections
        return []
    benches = list(vs)
    out = [
        "Against each seed's best single expert: exact McNemar p per seed, Holm-adjusted in "
        f"brackets ({CORRECTIONS['holm_vs_best_expert']}):",
        "",
        "| candidate | " + " | ".join(benches) + " |",
        "|---" * (len(benches) + 1) + "|",
    ]
    for c in next(iter(vs.values())):
        cells = [
            _ps(vs[b][c], adj[b][c]) if any(p is not None for p in vs[b][c]) else "–"
            for b in benches
        ]
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    if summary["pairs"]:
        out += [
            "",
            f"Head to head: exact McNemar p per seed (Holm in brackets: {CORRECTIONS['pairs.p_holm']}):",
            "",
            "| pair | " + " | ".join(benches) + " |",
            "|---" * (len(benches) + 1) + "|",
        ]
        for pair, per in summary["pairs"].items():
            cells = []
            for b in benches:
                tests = per.get(b) or []
                raw = [t["p_value"] if t else None for t in tests]
                cells.append(_ps(raw, [t["p_holm"] if t else None for t in tests]))
            out.append(f"| {pair} | " + " | ".join(cells) + " |")
    return out


def _fmt(s: dict[str, Any], scale: float = 1.0, digits: int = 1) -> str:
    if s["mean"] is None:
        return "–"
    m, lo, hi = (scale * s[k] for k in ("mean", "min", "max"))
    return f"{m:.{digits}f} [{lo:.{digits}f}–{hi:.{digits}f}]"


def termination_markdown(summary: dict[str, Any]) -> list[str]:
    """Premature termination, 2 vs 3 experts (plain EOS policy): mean [min–max] over seeds."""
    term = summary["termination"]
    rows = [k for k in term if k.endswith("/plain")]
    if not rows:
        return []
    benches = list(term[rows[0]])
    measures = [
        ("score", 100, 1),
        ("mean_generated_tokens", 1, 1),
        ("mean_length_ratio", 1, 2),
        ("shorter_than_reference", 100, 0),
        ("ends_right_after_marker", 100, 0),
        ("p_eos_inside_reference", 1, 4),
        ("eos_argmax_inside_share", 100, 0),
    ]
    out = [
        "Premature termination, plain EOS policy (score %, tokens, generated/reference length, "
        "% shorter than the reference, % ending right after '####', mean p(EOS) inside the "
        "reference, % items where EOS is the top token inside the reference):",
        "",
        "| experts | set | " + " | ".join(m for m, _, _ in measures) + " |",
        "|---" * (len(measures) + 2) + "|",
    ]
    for key in rows:
        for b in benches:
            cells = [_fmt(term[key][b][m], sc, d) for m, sc, d in measures]
            out.append(f"| {key.split('_')[0]} | {b} | " + " | ".join(cells) + " |")
    return out


def remedies_markdown(summary: dict[str, Any]) -> list[str]:
    """3-expert remedies chosen on validation: test score and McNemar p against plain."""
    rem = summary["remedies"]
    if not rem:
        return []
    benches = list(next(iter(rem.values()))["scores"])
    out = [
        "Remedies for 3 experts, chosen on validation, on test (score %, mean [min–max]; "
        "per-seed choice (w, EOS policy); per-seed exact McNemar p vs plain, Holm-adjusted in "
        f"brackets: {CORRECTIONS['remedies.holm_vs_plain']}):",
        "",
        "| remedy | chosen per seed | " + " | ".join(benches) + " |",
        "|---" * (len(benches) + 2) + "|",
    ]
    for label, row in rem.items():
        chosen = ", ".join(f"({w:g}, {p})" if w is not None else "–" for w, p in row["chosen"])
        cells = []
        for b in benches:
            ps = row["mcnemar_vs_plain"].get(b) or []
            held = row.get("holm_vs_plain", {}).get(b) or [None] * len(ps)
            pv = _ps(ps, held) if any(p is not None for p in ps) else ""
            cells.append(_fmt(row["scores"][b], 100) + (f" (p {pv})" if pv else ""))
        out.append(f"| {label} | {chosen} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="result folders (each with results.json)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    missing = [str(r) for r in args.runs if not (r / "results.json").exists()]
    if missing:
        p.error(f"no results.json in {missing}")
    runs = {str(r): json.loads((r / "results.json").read_text()) for r in args.runs}
    summary = summarise(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(summary)
    recognised = json_with_keys("runs", "seeds", "scores")
    write_json_atomic(
        args.out / "summary.json",
        summary,
        indent=1,
        ensure_ascii=True,
        written_by_mergelab=recognised,
    )
    with atomic_output_file(
        args.out / "summary.md", written_by_mergelab=starts_with("Test score (%)")
    ) as tmp:
        tmp.write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
