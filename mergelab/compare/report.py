"""The output folder: ``results.json`` (schema in docs/compare.md), ``table.md`` and the figures,
the last two drawn from results.json alone (``--plot-only`` redraws them from the file).

    out/
      results.json          spec, versions, splits, every job's per-item scores, choices,
                            statistics, costs
      table.md              one row per candidate: test score [95% CI] per benchmark, the
                            difference to the best single expert [CI] with its p-value, cost
      figures/scores.png    score with CI per benchmark (baselines as dashed floors)
      figures/score_vs_cost.png
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mergelab.compare.plan import made_of_text
from mergelab.outputs import atomic_output_dir

FIGURES = ("scores.png", "score_vs_cost.png")


def write_output(
    results: Mapping[str, Any],
    out: str | os.PathLike,
    *,
    force: bool = False,
    figures: bool = True,
    inputs=(),
) -> Path:
    """Write the output folder in one step (it appears only when complete)."""
    from mergelab.compare.run import dump

    text = dump(results)
    with atomic_output_dir(out, force=force, inputs=inputs, kind="compare") as tmp:
        (tmp / "results.json").write_text(text + "\n", encoding="utf-8")
        data = json.loads(text)  # draw from what is in the file, nothing else
        (tmp / "table.md").write_text(markdown_table(data), encoding="utf-8")
        if figures:
            draw_figures(data, tmp / "figures")
    return Path(out)


def plot_only(out: str | os.PathLike, figures: bool = True) -> Path:
    """Redraw ``table.md`` and the figures of an existing output from its results.json."""
    path = Path(out) / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run the comparison first")
    data = load_results(path)
    return write_output(data, out, force=True, figures=figures)


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    from mergelab.compare.run import RESULTS_SCHEMA, RESULTS_VERSION

    if data.get("schema") != RESULTS_SCHEMA:
        raise ValueError(f"{path} is not a mergelab compare results file")
    if data.get("schema_version") != RESULTS_VERSION:
        raise ValueError(
            f"{path}: schema_version {data.get('schema_version')} is not "
            f"{RESULTS_VERSION}, the one this mergelab reads"
        )
    return data


# ----------------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _ci(entry: Mapping[str, Any], key: str = "mean") -> str:
    if entry.get("low") is None:
        return _pct(entry[key])
    return f"{_pct(entry[key])} [{_pct(entry['low'])}, {_pct(entry['high'])}]"


def _p(x: float) -> str:
    return f"{x:.2g}" if x >= 0.001 else "<0.001"


def summary_rows(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One entry per row and benchmark, the numbers the table and figures show: score and
    interval (bootstrap over items for one seed; the seed-level interval for several), the
    difference to the best expert and its p-value (first seed when several), cost."""
    seeds = [str(s) for s in data["seeds"]]
    stats = data["statistics"]
    multi = stats.get("across_seeds")
    out = []
    for bench in data["benchmarks"]:
        first = stats["per_seed"][seeds[0]][bench]
        for row, ci in first["scores"].items():
            score = multi["benchmarks"][bench]["scores"][row] if multi else ci
            vs = first["vs_best_expert"].get(row)
            diff = None
            if vs is not None:
                pb = vs["paired_bootstrap"]
                diff = {
                    "mean": pb["mean_diff"],
                    "low": pb["low"],
                    "high": pb["high"],
                    "p": vs["p_value"],
                    "p_kind": vs["p_value_kind"],
                }
                if multi and row in multi["benchmarks"][bench]["vs_best_expert"]:
                    d = multi["benchmarks"][bench]["vs_best_expert"][row]
                    diff.update(mean=d["mean"], low=d["low"], high=d["high"])
            out.append(
                {
                    "benchmark": bench,
                    "row": row,
                    "score": score,
                    "diff": diff,
                    "best_expert": first["best_expert"],
                    "cost": data["costs"].get(row, {}).get(bench),
                }
            )
    return out


def markdown_table(data: Mapping[str, Any]) -> str:
    seeds = [str(s) for s in data["seeds"]]
    stats = data["statistics"]
    multi = stats.get("across_seeds")
    conf = int(round(100 * stats["confidence"]))
    families = {r["row"]: r for r in data["rows"]}
    choices = data["choices"][seeds[0]]["families"]
    benches = list(data["benchmarks"])
    rows = summary_rows(data)
    by = {(r["row"], r["benchmark"]): r for r in rows}
    lines = [f"# {data['name']}", ""]
    interval = (
        f"{multi['description']}, {len(seeds)} seeds"
        if multi
        else f"{conf}% bootstrap CI over items ({stats['bootstrap_samples']} resamples)"
    )
    lines.append(
        f"Test scores (%), {interval}. Δ: difference to the best single expert (chosen "
        "on validation) with its paired bootstrap CI; p: exact McNemar test for "
        "binary outcomes" + (" (first seed)" if multi else "") + "."
    )
    lines.append("")
    head = ["candidate", "family", "chosen on validation"]
    for b in benches:
        head += [f"{b}", f"Δ {b}", "p"]
    head += ["model evals/token", "ms/token"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in data["rows"]:
        row = r["row"]
        fam = families[row]["family"]
        chosen = choices.get(row, {}).get("chosen", "") if row in choices else ""
        cells = [row, fam + (f" ({r['method']})" if r.get("method") else ""), chosen or "–"]
        for b in benches:
            e = by[(row, b)]
            cells.append(_ci(e["score"]))
            if e["diff"] is None:
                best = e["best_expert"] == row
                cells += ["best expert" if best else "–", "–"]
            else:
                d = e["diff"]
                sign = "+" if d["mean"] >= 0 else ""
                cells += [
                    f"{sign}{_pct(d['mean'])} [{_pct(d['low'])}, {_pct(d['high'])}]",
                    _p(d["p"]),
                ]
        cost = [by[(row, b)]["cost"] for b in benches if by[(row, b)]["cost"]]
        evals = cost[0]["model_evaluations_per_token"] if cost else None
        ms = sum(c["ms_per_token"] for c in cost) / len(cost) if cost else None
        cells += ["–" if evals is None else f"{evals:g}", "–" if ms is None else f"{ms:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    made = [f"- {r['row']}: {made_of_text(r['made_of'])}" for r in data["rows"] if "made_of" in r]
    if made:
        lines += ["", "What each row is made of:", *made]
    floors = stats["per_seed"][seeds[0]]
    base_lines = []
    for b in benches:
        for name, ci in (floors[b].get("baselines") or {}).items():
            base_lines.append(f"- baseline `{name}` on {b}: {_ci(ci)}")
    if base_lines:
        lines += ["", "Baselines (floors, test split" + (", first seed" if multi else "") + "):"]
        lines += base_lines
    lines += [
        "",
        "Best single expert per benchmark (validation): "
        + ", ".join(
            f"{b}: {floors[b]['best_expert'] or 'none (no validation split)'}" for b in benches
        ),
    ]
    lines.append("")
    return "\n".join(lines)


def draw_figures(data: Mapping[str, Any], folder: str | os.PathLike) -> list[Path]:
    """Scores with intervals per benchmark, and score vs cost, from results.json's content."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(data)
    benches = list(data["benchmarks"])
    names = [r["row"] for r in data["rows"]]
    seeds = [str(s) for s in data["seeds"]]
    floors = data["statistics"]["per_seed"][seeds[0]]
    by = {(r["row"], r["benchmark"]): r for r in rows}

    fig, axes = plt.subplots(
        1,
        len(benches),
        figsize=(4 + 3 * len(benches), 0.5 * len(names) + 1.5),
        squeeze=False,
        sharey=True,
    )
    for ax, b in zip(axes[0], benches):
        ys = range(len(names))
        means = [100 * by[(n, b)]["score"]["mean"] for n in names]
        lows = [
            100
            * (
                by[(n, b)]["score"]["low"]
                if by[(n, b)]["score"]["low"] is not None
                else by[(n, b)]["score"]["mean"]
            )
            for n in names
        ]
        highs = [
            100
            * (
                by[(n, b)]["score"]["high"]
                if by[(n, b)]["score"]["high"] is not None
                else by[(n, b)]["score"]["mean"]
            )
            for n in names
        ]
        err = [[m - lo for m, lo in zip(means, lows)], [hi - m for m, hi in zip(means, highs)]]
        ax.barh(list(ys), means, xerr=err, color="#4c72b0", alpha=0.8, capsize=3)
        for name, ci in (floors[b].get("baselines") or {}).items():
            ax.axvline(100 * ci["mean"], ls="--", color="gray", lw=1)
            ax.text(100 * ci["mean"], len(names) - 0.5, f" {name}", fontsize=7, color="gray")
        ax.set_yticks(list(ys), names)
        ax.invert_yaxis()
        ax.set_xlabel(f"{b}: test score (%)")
        ax.set_xlim(0, 100)
    fig.tight_layout()
    paths = [folder / FIGURES[0]]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    markers = "osD^v<>p*"
    for j, b in enumerate(benches):
        for n in names:
            e = by[(n, b)]
            if not e["cost"]:
                continue
            ax.scatter(e["cost"]["ms_per_token"], 100 * e["score"]["mean"], marker=markers[j % 9])
            ax.annotate(
                n,
                (e["cost"]["ms_per_token"], 100 * e["score"]["mean"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ax.set_xlabel("ms per generated token (test, this machine)")
    ax.set_ylabel("test score (%)")
    ax.set_title(" · ".join(f"{markers[j % 9]} {b}" for j, b in enumerate(benches)), fontsize=9)
    fig.tight_layout()
    paths.append(folder / FIGURES[1])
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
