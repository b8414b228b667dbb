"""The LLM study's figures and table, drawn from ``results.json`` alone (one function each)."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from mergelab import figure_style as fs
from mergelab.compose import EOS_POLICIES
from mergelab.results import save_figure


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def panel_has_data(ax) -> bool:
    """Whether a panel shows anything: a line with a finite point, a bar, or scattered points."""
    import numpy as np

    lines = any(np.isfinite(np.asarray(ln.get_ydata(), dtype=float)).any() for ln in ax.lines)
    points = any(len(c.get_offsets()) for c in ax.collections)
    return lines or points or bool(ax.patches)


def _save(fig, path: Path, *, rect=(0, 0, 1, 1), layout: bool = True) -> Path:
    """Write the figure; refuse one with an empty panel (a figure is written complete or not at
    all: a panel without data means the results file lacks what the figure draws)."""
    empty = [ax.get_title() or str(i) for i, ax in enumerate(fig.axes) if not panel_has_data(ax)]
    if empty:
        import matplotlib.pyplot as plt

        plt.close(fig)  # refused: nothing written, nothing left open
        raise ValueError(f"{path.name}: no data for the panel(s) {empty}; nothing written")
    if layout:  # not where labels were placed for the layout already made
        fig.tight_layout(rect=rect)
    return save_figure(fig, path, dpi=150, tight=True)


def ms_per_token(cost: dict[str, Any]) -> float:
    """Wall time per generated token in ms (results files before the move to mergelab.compare
    recorded seconds)."""
    return cost["ms_per_token"] if "ms_per_token" in cost else 1000 * cost["seconds_per_token"]


# Colours for things that are not candidate families (EOS policies, thresholds): Okabe–Ito too,
# in an order that starts away from the family colours.
POLICY_COLORS = ("#000000", "#CC79A7", "#E69F00", "#56B4E9", "#009E73", "#D55E00", "#0072B2")


def _styled(draw):
    """Draw inside mergelab's figure style (:mod:`mergelab.figure_style`)."""

    @functools.wraps(draw)
    def wrapper(*args, **kwargs):
        with fs.style():
            return draw(*args, **kwargs)

    return wrapper


def _color(c: str) -> str:
    """A candidate's family colour, the same in every mergelab figure."""
    return fs.family_color(fs.candidate_family(c))


def _interval(res: dict[str, Any]) -> str:
    """What the score intervals are, from the first score record, and the seed."""
    table = res["candidates"]
    first = next(iter(next(iter(table.values())).values()))["score"]
    conf = round(100 * first.get("confidence", 0.95))
    ns = {r["score"].get("n") for recs in table.values() for r in recs.values()}
    items = f" over {ns.pop()} test items" if len(ns) == 1 else " over each benchmark's test items"
    return f"{conf}% bootstrap CIs{items}, seed {res['config'].get('seed', 0)}"


def _percent_axis(ax, axis: str = "y") -> None:
    (ax.set_ylim if axis == "y" else ax.set_xlim)(0, 105)
    (ax.set_yticks if axis == "y" else ax.set_xticks)([0, 25, 50, 75, 100])


@_styled
def scores(res: dict[str, Any], path: Path) -> Path:
    """Score with its 95% CI per candidate and benchmark; the trivial baseline as a line."""
    _plt()
    table = res["candidates"]
    benches = list(next(iter(table.values())).keys())
    cands = list(table)
    floors = (res.get("baselines") or {}).get("sum_of_numbers", {})
    fig, axes = fs.panels(len(benches), 0.3 * len(cands) + 1.0, 3.8, sharey=True)
    colors = [_color(c) for c in cands]
    for ax, b in zip(axes, benches):
        ys = [100 * table[c][b]["score"]["mean"] for c in cands]
        lo = [y - 100 * table[c][b]["score"]["low"] for c, y in zip(cands, ys)]
        hi = [100 * table[c][b]["score"]["high"] - y for c, y in zip(cands, ys)]
        ax.bar(range(len(cands)), ys, color=colors, width=0.75)
        ax.errorbar(
            range(len(cands)), ys, yerr=[lo, hi], fmt="none", ecolor="#333333", capsize=2, lw=0.8
        )
        if b in floors:
            ax.axhline(
                100 * floors[b]["score"],
                color=fs.FLOOR_COLOR,
                ls="--",
                lw=0.9,
                label="floor: sum of the numbers",
            )
            ax.legend(loc="upper right")
        ax.set_xticks(range(len(cands)), cands, rotation=75, ha="right", rotation_mode="anchor")
        ax.grid(axis="x", visible=False)
        ax.set_title(b)
        _percent_axis(ax)
        ax.set_ylabel("test score (%)")
    fs.family_legend(
        axes[-1],
        [fs.candidate_family(c) for c in cands],
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        title="family",
    )
    fig.suptitle(f"{res['config']['scale']}: test scores with {_interval(res)}", fontweight="bold")
    return _save(fig, path)


@_styled
def quality_cost(res: dict[str, Any], path: Path) -> Path:
    """Mean score over benchmarks vs model evaluations and wall time per generated token."""
    plt = _plt()
    table = res["candidates"]
    benches = list(next(iter(table.values())).keys())
    cands = list(table)
    fig, axes = plt.subplots(2, 1, figsize=(6.4, 7.2))
    score = [100 * sum(table[c][b]["score"]["mean"] for b in benches) / len(benches) for c in cands]
    evals = [table[c][benches[0]]["cost"]["model_evaluations_per_token"] for c in cands]
    ms = [sum(ms_per_token(table[c][b]["cost"]) for b in benches) / len(benches) for c in cands]
    colors = [_color(c) for c in cands]
    xlabels = (
        "model evaluations per generated token",
        "wall time per generated token (ms, CPU, shared machine)",
    )
    titles = ("score vs model evaluations", "score vs wall time")
    for ax, xs, xlabel, title in zip(axes, (evals, ms), xlabels, titles):
        ax.scatter(xs, score, c=colors, s=28, zorder=3)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean test score over benchmarks (%)")
        ax.set_title(title, loc="left")
        top = max(score)
        ax.set_ylim(-0.05 * max(top, 1), 1.1 * max(top, 1))
        if xs is evals:
            ax.set_xticks(sorted(set(evals)))
            ax.set_xlim(min(evals) - 0.5, max(evals) + 0.5)
    fig.suptitle(
        f"{res['config']['scale']}: score vs cost ({', '.join(benches)}; "
        f"seed {res['config'].get('seed', 0)})",
        fontweight="bold",
    )
    fig.tight_layout()
    for ax, xs in zip(axes, (evals, ms)):  # labels beside the axes, placed for the final layout
        fs.label_points(ax, xs, score, cands, colors)
    fs.family_legend(
        axes[-1],
        [fs.candidate_family(c) for c in cands],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25),
        ncol=3,
    )
    return _save(fig, path, layout=False)


def _mean(row: dict[str, Any], f, benches) -> float:
    vals = [f(row["benchmarks"][b]) for b in benches]
    vals = [v for v in vals if v is not None and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else float("nan")


@_styled
def termination(res: dict[str, Any], path: Path) -> Path | None:
    """2 vs 3 experts per EOS policy: score, length relative to the reference, share of
    outputs shorter than the reference, p(EOS) inside the reference (teacher-forced)."""
    term = res.get("termination") or {}
    if not term.get("rows"):
        return None
    _plt()
    rows_all = term["rows"]
    policies = sorted({r["eos_policy"] for r in rows_all}, key=list(EOS_POLICIES).index)
    tb = list(rows_all[0]["benchmarks"])
    own = [b for b in tb if b != term.get("third_expert")]
    third = [b for b in tb if b not in own]

    def pct(v):
        return None if v is None else 100 * v

    metrics = [
        (lambda x: pct(x["score"]["mean"]), "test score", "mean test score (%)"),
        (lambda x: x["cost"]["mean_new_tokens"], "generated length", "mean generated tokens"),
        (
            lambda x: x.get("premature", {}).get("mean_length_ratio"),
            "length vs the reference",
            "generated / reference length (ratio)",
        ),
        (
            lambda x: pct(x.get("premature", {}).get("shorter_than_reference")),
            "stops early",
            "outputs shorter than the reference (%)",
        ),
        (
            lambda x: x["eos_prob"].get("inside_reference"),
            "p(EOS) inside the reference",
            "mean p(EOS), teacher-forced (log)",
        ),
    ]
    # Only what the file records (results files of earlier versions lack some measures); the
    # generated length in tokens only where the length relative to the reference is missing.
    metrics = [m for m in metrics if any(not math.isnan(_mean(r, m[0], tb)) for r in rows_all)]
    if any(m[1] == "length vs the reference" for m in metrics):
        metrics = [m for m in metrics if m[1] != "generated length"]
    fig, axes = fs.panels(len(metrics), 3.6, 3.2)
    for i, policy in enumerate(policies):
        rows = sorted(
            (r for r in rows_all if r["eos_policy"] == policy), key=lambda r: r["n_experts"]
        )
        ks = [r["n_experts"] for r in rows]
        style = {"color": POLICY_COLORS[i % len(POLICY_COLORS)], "marker": "o"}
        for j, (f, *_) in enumerate(metrics):
            axes[j].plot(ks, [_mean(r, f, own) for r in rows], label=policy, **style)
        if third:
            axes[0].plot(ks, [_mean(r, metrics[0][0], third) for r in rows], ls="--", **style)
    for ax, (_, title, ylabel) in zip(axes, metrics):
        ax.set_xlabel("experts composed")
        ax.set_xticks([2, 3])
        ax.set_xlim(1.8, 3.2)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if title.startswith("p(EOS)"):
            ax.set_yscale("log")
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        title="EOS policy",
        loc="lower center",
        ncol=len(policies),
    )
    fig.suptitle(
        f"{term_scale(res)}: logit composition of 2 vs 3 experts per EOS policy "
        f"(means over {', '.join(own)}"
        + (f"; dashed: third skill, {', '.join(third)})" if third else ")"),
        fontweight="bold",
    )
    return _save(fig, path, rect=(0, 0.12 / math.ceil(len(metrics) / fs.MAX_COLUMNS), 1, 1))


def term_scale(res: dict[str, Any]) -> str:
    return f"{res['config']['scale']}, seed {res['config'].get('seed', 0)}"


@_styled
def eos_profile(res: dict[str, Any], path: Path) -> Path | None:
    """p(EOS) along the reference (by fifths of its length) for 2 and 3 experts (plain policy)
    and the single experts, per benchmark: where the composition wants to stop."""
    term = res.get("termination") or {}
    rows = [r for r in term.get("rows", []) if r["eos_policy"] == "plain"]
    singles = term.get("single_expert_eos_prob", {})
    if not rows:
        return None
    benches = [
        b
        for b in rows[0]["benchmarks"]
        if any(r["benchmarks"][b]["eos_prob"].get("inside_by_fifth") for r in rows)
        or any(per.get(b, {}).get("inside_by_fifth") for per in singles.values())
    ]
    if not benches:  # results files of earlier versions have no profile along the reference
        return None
    _plt()
    fig, axes = fs.panels(len(benches), 3.4, 3.0, sharey=True)
    for ax, b in zip(axes, benches):
        for r in rows:
            prof = r["benchmarks"][b]["eos_prob"].get("inside_by_fifth")
            if prof:
                ax.plot(
                    range(1, len(prof) + 1),
                    prof,
                    marker="o",
                    color=fs.family_color("composition"),
                    ls="-" if r["n_experts"] == 2 else "--",
                    label=f"composition of {r['n_experts']} experts",
                )
        for k, (name, per) in enumerate(singles.items()):
            prof = per.get(b, {}).get("inside_by_fifth")
            if prof:
                ax.plot(
                    range(1, len(prof) + 1),
                    prof,
                    ls=":",
                    marker="os^D"[k % 4],
                    ms=3,
                    color=fs.family_color("expert"),
                    label=f"{name} expert",
                )
        ax.set_yscale("log")
        ax.set_title(b)
        ax.set_xlabel("fifth of the reference (1 = start)")
        ax.set_xticks(range(1, 6))
        ax.set_ylabel("mean p(EOS), teacher-forced (log)")
    axes[0].legend()
    fig.suptitle(
        f"{term_scale(res)}: where the models want to stop (plain EOS policy)", fontweight="bold"
    )
    return _save(fig, path)


@_styled
def remedies(res: dict[str, Any], path: Path) -> Path | None:
    """3 experts: test score per benchmark of the plain composition and each remedy chosen on
    validation, with the share of outputs shorter than the reference."""
    rem = (res.get("remedies") or {}).get("rows")
    if not rem:
        return None
    plt = _plt()
    labels = list(rem)
    benches = list(rem[labels[0]]["benchmarks"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        row = rem[label]
        name = f"{label} (w={row['weight']:g}, {row['eos_policy']})"
        xs = [j + i * width for j in range(len(benches))]
        color = POLICY_COLORS[i % len(POLICY_COLORS)]
        score = [100 * row["benchmarks"][b]["score"]["mean"] for b in benches]
        axes[0].bar(xs, score, width, label=name, color=color)
        short = [row["benchmarks"][b]["premature"].get("shorter_than_reference") for b in benches]
        axes[1].bar(xs, [100 * s if s is not None else 0 for s in short], width, color=color)
    titles = ("test score", "outputs shorter than the reference")
    ylabels = ("test score (%)", "outputs shorter than the reference (%)")
    for ax, title, ylabel in zip(axes, titles, ylabels):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(benches))], benches)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(axis="x", visible=False)
        _percent_axis(ax)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(3, len(labels)))
    fig.suptitle(
        f"{term_scale(res)}: 3 experts, plain composition and the remedies chosen on validation",
        fontweight="bold",
    )
    return _save(fig, path, rect=(0, 0.1, 1, 1))


@_styled
def diagnostics(res: dict[str, Any], path: Path) -> Path | None:
    """Where the experts are active and co-active, and whether co-activity predicts the gain."""
    diag = {b: d for b, d in (res.get("diagnostics") or {}).items() if "active_fraction" in d}
    if not diag:
        return None
    plt = _plt()
    db = list(diag)
    keys = [f"{t:g}" for t in next(iter(diag.values()))["thresholds"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    width = 0.8 / (2 * len(keys))
    for j, t in enumerate(keys):
        for e, name in enumerate(("math", "code")):
            xs = [i + (2 * j + e) * width for i in range(len(db))]
            axes[0].bar(
                xs,
                [100 * diag[b]["active_fraction"][name][t] for b in db],
                width,
                label=f"{name}: KL>{t}",
                color=POLICY_COLORS[(2 * j + e) % len(POLICY_COLORS)],
            )
    axes[0].set_xticks([i + width * (2 * len(keys) - 1) / 2 for i in range(len(db))], db)
    axes[0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(keys))
    axes[0].set_title("expert active")
    axes[0].set_ylabel("tokens where the expert is active (%)")
    for j, t in enumerate(keys):
        both = [100 * diag[b]["coactive_fraction"]["math&code"][t] for b in db]
        axes[1].bar(
            [i + j * 0.25 for i in range(len(db))],
            both,
            0.25,
            label=f"both active, KL>{t}",
            color=POLICY_COLORS[j % len(POLICY_COLORS)],
        )
    differs = [100 * diag[b]["composed_top1_differs_fraction"] for b in db]
    axes[1].plot(
        [i + 0.25 * (len(keys) - 1) / 2 for i in range(len(db))],
        differs,
        "k*",
        markersize=10,
        label="composed top-1 differs from all",
        zorder=3,
    )
    axes[1].set_xticks([i + 0.25 * (len(keys) - 1) / 2 for i in range(len(db))], db)
    axes[1].legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    axes[1].set_title("co-activity (where factorisation fails)")
    axes[1].set_ylabel("tokens (%)")
    for ax in axes[:2]:
        _percent_axis(ax)
        ax.grid(axis="x", visible=False)
    paired = res.get("paired_vs_best_expert", {})
    for b in db:
        if b in paired and "composition" in paired[b]["vs"]:
            x = 100 * diag[b]["coactive_fraction"]["math&code"]["0.1"]
            y = paired[b]["vs"]["composition"]["paired_bootstrap"]
            mid = 100 * y["mean_diff"]
            err = [[mid - 100 * y["low"]], [100 * y["high"] - mid]]
            axes[2].errorbar(
                x, mid, yerr=err, fmt="o", color=fs.family_color("composition"), capsize=2
            )
            axes[2].annotate(b, (x, mid), xytext=(5, 3), textcoords="offset points")
    axes[2].axhline(0, color="gray", lw=0.5)
    axes[2].set_xlabel("tokens with both experts active, KL>0.1 (%)")
    axes[2].set_ylabel("composition − best expert (% points)")
    axes[2].set_title("does co-activity predict the gain? (95% paired CI)")
    fig.suptitle(f"{term_scale(res)}: per-token diagnostics (KL in nats)", fontweight="bold")
    return _save(fig, path)


FIGURES = {
    "scores": scores,
    "quality_cost": quality_cost,
    "termination": termination,
    "eos_profile": eos_profile,
    "remedies": remedies,
    "diagnostics": diagnostics,
}


def draw_all(res: dict[str, Any], folder: Path, prefix: str) -> list[Path]:
    """Every figure that ``res`` has data for, as ``folder/<prefix><name>.png``."""
    drawn = [f(res, folder / f"{prefix}{name}.png") for name, f in FIGURES.items()]
    return [p for p in drawn if p is not None]


def markdown_table(res: dict[str, Any]) -> str:
    """Score [95% CI] per benchmark, Δ vs the best expert with its exact McNemar p-value, cost;
    the trivial baseline as the last row."""
    table = res["candidates"]
    benches = list(next(iter(table.values())).keys())
    paired = res.get("paired_vs_best_expert", {})
    lines = [
        "| candidate | " + " | ".join(benches) + " | evals/token | ms/token |",
        "|" + "---|" * (len(benches) + 3),
    ]
    for c, recs in table.items():
        cells = []
        for b in benches:
            sc = recs[b]["score"]
            cell = f"{100 * sc['mean']:.1f} [{100 * sc['low']:.0f}, {100 * sc['high']:.0f}]"
            vs = paired.get(b, {}).get("vs", {}).get(c)
            if vs is not None:
                p = (
                    vs["mcnemar"]["p_value"]
                    if "mcnemar" in vs
                    else vs["paired_bootstrap"]["p_value"]
                )
                cell += f" (Δ {100 * vs['paired_bootstrap']['mean_diff']:+.1f}, p={p:.2g})"
            cells.append(cell)
        evals = recs[benches[0]]["cost"].get("model_evaluations_per_token", "?")
        ms = sum(ms_per_token(recs[b]["cost"]) for b in benches) / len(benches)
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {evals} | {ms:.1f} |")
    floors = (res.get("baselines") or {}).get("sum_of_numbers", {})
    if floors:
        cells = [f"{100 * floors[b]['score']:.1f}" if b in floors else "–" for b in benches]
        lines.append("| *baseline: sum of the numbers* | " + " | ".join(cells) + " | 0 | – |")
    return "\n".join(lines)
