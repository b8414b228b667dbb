"""The output folder: ``results.json`` (schema in docs/compare.md), ``table.md`` and the figures,
the last two drawn from results.json alone (``--plot-only`` redraws them from the file).

    out/
      results.json          spec, versions, splits, every job's per-item scores, choices,
                            statistics, costs
      table.md              one row per candidate: test score [95% CI] per benchmark, the
                            difference to the best single expert [CI] with its p-value and the
                            Holm-adjusted p (family: the rows vs the best expert), cost
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
from mergelab.compare.results_file import dump, load_results
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
                    "p_holm": vs.get("p_holm"),
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
        "binary outcomes" + (" (first seed)" if multi else "") + "; p Holm: p adjusted by "
        "Holm's step-down method over its family, the rows against the best expert on the same "
        "benchmark" + (" and seed" if multi else "") + "."
    )
    lines.append("")
    head = ["candidate", "family", "chosen on validation"]
    for b in benches:
        head += [f"{b}", f"Δ {b}", "p", "p Holm"]
    kinds = {_counted(c) for r in rows if (c := r["cost"])}
    kind = next(iter(kinds)) if len(kinds) == 1 else None  # one kind: named in the header
    what = f"{kind} " if kind else ""
    head += ["model evals/token", f"{what}tokens/item", f"ms/{what}token"]
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
                cells += ["best expert" if best else "–", "–", "–"]
            else:
                d = e["diff"]
                sign = "+" if d["mean"] >= 0 else ""
                cells += [
                    f"{sign}{_pct(d['mean'])} [{_pct(d['low'])}, {_pct(d['high'])}]",
                    _p(d["p"]),
                    "–" if d["p_holm"] is None else _p(d["p_holm"]),
                ]
        cost = [by[(row, b)]["cost"] for b in benches if by[(row, b)]["cost"]]
        evals = cost[0]["model_evaluations_per_token"] if cost else None
        cells.append("–" if evals is None else f"{evals:g}")
        cells += _cost_cells(cost, labelled=kind is None)
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", COST_NOTE]
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


COST_NOTE = (
    "Cost (test split, on the machine that ran it): tokens/item and ms/token count *generated* "
    "tokens where the benchmark generates, and *scored* tokens — the continuation tokens whose "
    "log-probabilities are summed, every choice's — where it scores (multiple choice, lm-eval's "
    "log-likelihood requests); ms is the model's time."
)


def _counted(cost: Mapping[str, Any]) -> str:
    return cost.get("tokens_counted", "generated")  # results written before it was recorded


def _cost_cells(cost: list[Mapping[str, Any]], labelled: bool) -> list[str]:
    """Tokens per item and ms per token of one row, averaged over benchmarks that count the same
    tokens; with several kinds in the table, each value names its kind."""
    by_kind: dict[str, list[Mapping[str, Any]]] = {}
    for c in cost:
        by_kind.setdefault(_counted(c), []).append(c)
    cells = [[], []]
    for kind, cs in by_kind.items():
        for cell, key, fmt in (
            (cells[0], "tokens_per_item", ".1f"),
            (cells[1], "ms_per_token", ".2f"),
        ):
            values = [c.get(key) for c in cs]
            if any(v is None for v in values):
                continue
            text = format(sum(values) / len(values), fmt)
            cell.append(f"{text} ({kind})" if labelled else text)
    return [" · ".join(cell) or "–" for cell in cells]


def _interval(entry: Mapping[str, Any]) -> tuple[float, float, float]:
    """(mean, low, high) in %, the interval collapsed to the mean where it is missing."""
    mean = entry["mean"]
    low = entry["low"] if entry["low"] is not None else mean
    high = entry["high"] if entry["high"] is not None else mean
    return 100 * mean, 100 * low, 100 * high


def draw_figures(data: Mapping[str, Any], folder: str | os.PathLike) -> list[Path]:
    """Scores with intervals per benchmark, and score vs cost, from results.json's content.
    Families keep one colour (:mod:`mergelab.figure_style`); labels never overlap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    from mergelab import figure_style as fs

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(data)
    benches = list(data["benchmarks"])
    names = [r["row"] for r in data["rows"]]
    family = {r["row"]: r["family"] for r in data["rows"]}
    colors = [fs.family_color(family[n]) for n in names]
    seeds = [str(s) for s in data["seeds"]]
    floors = data["statistics"]["per_seed"][seeds[0]]
    by = {(r["row"], r["benchmark"]): r for r in rows}
    conf = int(round(100 * data["statistics"]["confidence"]))
    over = "seeds (Student-t)" if len(seeds) > 1 else "test items (bootstrap)"
    title = data.get("name") or "comparison"
    paths = [folder / FIGURES[0], folder / FIGURES[1]]

    with fs.style():
        fig, axes = plt.subplots(
            1,
            len(benches),
            figsize=(2.2 + 2.6 * len(benches), 0.32 * len(names) + 1.6),
            squeeze=False,
            sharey=True,
        )
        ys = list(range(len(names)))
        for ax, b in zip(axes[0], benches):
            stats = [_interval(by[(n, b)]["score"]) for n in names]
            means = [s[0] for s in stats]
            err = [[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]]
            ax.barh(ys, means, color=colors, height=0.7)
            ax.errorbar(means, ys, xerr=err, fmt="none", ecolor="#333333", capsize=2, lw=0.8)
            for y, (m, _, hi) in zip(ys, stats):
                ax.text(min(hi, 100) + 1.5, y, f"{m:.0f}", va="center", fontsize=7)
            for name, ci in (floors[b].get("baselines") or {}).items():
                ax.axvline(100 * ci["mean"], ls="--", color=fs.FLOOR_COLOR, lw=0.9)
                ax.text(100 * ci["mean"], -0.9, f" floor: {name}", fontsize=7, va="bottom")
            ax.set_title(b)
            ax.set_xlim(0, 112)
            ax.set_xticks([0, 25, 50, 75, 100])
            ax.set_xlabel("test score (%)")
            ax.grid(axis="y", visible=False)
        axes[0][0].set_yticks(ys, names)
        axes[0][0].set_ylim(len(names) - 0.5, -1.2)
        fs.family_legend(
            axes[0][-1],
            [family[n] for n in names],
            loc="upper left",
            bbox_to_anchor=(1.02, 1.0),
            title="family",
        )
        fig.suptitle(f"{title}: test scores with {conf}% CIs over {over}", fontweight="bold")
        fig.tight_layout()
        fig.savefig(paths[0])
        plt.close(fig)

        fig, axes = plt.subplots(
            len(benches), 1, figsize=(6.4, 2.9 * len(benches) + 0.6), squeeze=False
        )
        for ax, b in zip(axes[:, 0], benches):
            points = [
                (n, by[(n, b)]["cost"]["ms_per_token"], 100 * by[(n, b)]["score"]["mean"])
                for n in names
                if by[(n, b)]["cost"] and by[(n, b)]["cost"]["ms_per_token"] is not None
            ]
            xs = [x for _, x, _ in points]
            point_colors = [fs.family_color(family[n]) for n, *_ in points]
            ax.scatter(xs, [y for *_, y in points], c=point_colors, s=28, zorder=3)
            if xs and max(xs) > 10 * min(xs) > 0:
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
            ax.set_ylim(-5, 105)
            ax.set_title(b, loc="left")
            counted = {_counted(by[(n, b)]["cost"]) for n in names if by[(n, b)]["cost"]}
            ax.set_xlabel(f"ms per {' / '.join(sorted(counted)) or 'generated'} token")
            ax.set_ylabel("test score (%)")
            fs.label_points(
                ax,
                xs,
                [y for *_, y in points],
                [n for n, *_ in points],
                point_colors,
            )
        last = axes[-1][0]
        last.set_xlabel(f"{last.get_xlabel()} (test split, on the machine that ran it)")
        fs.family_legend(
            axes[-1][0],
            [family[n] for n in names],
            loc="upper center",
            bbox_to_anchor=(0.5, -0.28),
            ncol=len(set(family.values())),
        )
        fig.suptitle(f"{title}: score vs cost per benchmark", fontweight="bold")
        fig.tight_layout()
        fig.savefig(paths[1])
        plt.close(fig)
    return paths
