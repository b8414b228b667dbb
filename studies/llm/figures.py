"""The LLM study's figures and table, drawn from ``results.json`` alone (one function each)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

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


def _save(fig, path: Path) -> Path:
    """Write the figure; refuse one with an empty panel (a figure is written complete or not at
    all: a panel without data means the results file lacks what the figure draws)."""
    empty = [ax.get_title() or str(i) for i, ax in enumerate(fig.axes) if not panel_has_data(ax)]
    if empty:
        raise ValueError(f"{path.name}: no data for the panel(s) {empty}; nothing written")
    fig.tight_layout()
    return save_figure(fig, path, dpi=120, tight=False)


def ms_per_token(cost: dict[str, Any]) -> float:
    """Wall time per generated token in ms (results files before the move to mergelab.compare
    recorded seconds)."""
    return cost["ms_per_token"] if "ms_per_token" in cost else 1000 * cost["seconds_per_token"]


def _color(c: str) -> str:
    if "compos" in c:
        return "tab:red"
    if c == "base" or "expert" in c or c.endswith("_lora"):
        return "tab:gray"
    return "tab:blue"


def scores(res: dict[str, Any], path: Path) -> Path:
    """Score with its 95% CI per candidate and benchmark; the trivial baseline as a line."""
    plt = _plt()
    table = res["candidates"]
    benches = list(next(iter(table.values())).keys())
    cands = list(table)
    floors = (res.get("baselines") or {}).get("sum_of_numbers", {})
    fig, axes = plt.subplots(1, len(benches), figsize=(3.2 * len(benches), 3.6), sharey=True,
                             squeeze=False)  # fmt: skip
    for ax, b in zip(axes[0], benches):
        ys = [table[c][b]["score"]["mean"] for c in cands]
        lo = [y - table[c][b]["score"]["low"] for c, y in zip(cands, ys)]
        hi = [table[c][b]["score"]["high"] - y for c, y in zip(cands, ys)]
        ax.bar(range(len(cands)), ys, yerr=[lo, hi], color=[_color(c) for c in cands], capsize=2)
        if b in floors:
            ax.axhline(floors[b]["score"], color="k", ls="--", lw=0.8, label="sum of the numbers")
            ax.legend(fontsize=6)
        ax.set_xticks(range(len(cands)), cands, rotation=75, fontsize=7)
        ax.set_title(b, fontsize=9)
        ax.set_ylim(0, 1.05)
    axes[0][0].set_ylabel("score (95% bootstrap CI)")
    title = f"{res['config']['scale']}: red = logit composition, blue = weight merge"
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def quality_cost(res: dict[str, Any], path: Path) -> Path:
    """Mean score over benchmarks vs model evaluations and wall time per generated token."""
    plt = _plt()
    table = res["candidates"]
    benches = list(next(iter(table.values())).keys())
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for c, recs in table.items():
        score = sum(recs[b]["score"]["mean"] for b in benches) / len(benches)
        evals = recs[benches[0]]["cost"]["model_evaluations_per_token"]
        ms = sum(ms_per_token(recs[b]["cost"]) for b in benches) / len(benches)
        for ax, x in zip(axes, (evals, ms)):
            ax.scatter(x, score, color="tab:red" if "compos" in c else "tab:blue")
            ax.annotate(c, (x, score), fontsize=6)
    axes[0].set_xlabel("model evaluations per generated token")
    axes[1].set_xlabel("wall time per generated token (ms, CPU, shared machine)")
    for ax in axes:
        ax.set_ylabel("mean score over benchmarks")
    return _save(fig, path)


def _mean(row: dict[str, Any], f, benches) -> float:
    vals = [f(row["benchmarks"][b]) for b in benches]
    vals = [v for v in vals if v is not None and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else float("nan")


def termination(res: dict[str, Any], path: Path) -> Path | None:
    """2 vs 3 experts per EOS policy: score, length relative to the reference, share of
    outputs shorter than the reference, p(EOS) inside the reference (teacher-forced)."""
    term = res.get("termination") or {}
    if not term.get("rows"):
        return None
    plt = _plt()
    rows_all = term["rows"]
    policies = sorted({r["eos_policy"] for r in rows_all}, key=list(EOS_POLICIES).index)
    tb = list(rows_all[0]["benchmarks"])
    own = [b for b in tb if b != term.get("third_expert")]
    metrics = [
        (lambda x: x["score"]["mean"], "mean score: math, code, mixed (solid), third skill (dashed)"),
        (lambda x: x["cost"]["mean_new_tokens"], "mean generated tokens"),
        (lambda x: x.get("premature", {}).get("mean_length_ratio"), "generated / reference length"),
        (lambda x: x.get("premature", {}).get("shorter_than_reference"), "share shorter than the reference"),
        (lambda x: x["eos_prob"].get("inside_reference"), "mean p(EOS) inside the reference"),
    ]  # fmt: skip
    # Only what the file records (results files of earlier versions lack some measures); the
    # generated length in tokens only where the length relative to the reference is missing.
    metrics = [m for m in metrics if any(not math.isnan(_mean(r, m[0], tb)) for r in rows_all)]
    if any(m[1] == "generated / reference length" for m in metrics):
        metrics = [m for m in metrics if m[1] != "mean generated tokens"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.6))
    for i, policy in enumerate(policies):
        rows = sorted(
            (r for r in rows_all if r["eos_policy"] == policy), key=lambda r: r["n_experts"]
        )
        ks = [r["n_experts"] for r in rows]
        style = {"color": f"C{i}", "marker": "o"}
        for j, (f, _) in enumerate(metrics):
            axes[j].plot(ks, [_mean(r, f, own) for r in rows], label=policy, **style)
        third = [b for b in tb if b not in own]
        if third:
            axes[0].plot(ks, [_mean(r, metrics[0][0], third) for r in rows], ls="--", **style)
    for ax, (_, title) in zip(axes, metrics):
        ax.set_xlabel("experts composed")
        ax.set_xticks([2, 3])
        ax.set_title(title, fontsize=9)
    if metrics[-1][1].startswith("mean p(EOS)"):
        axes[-1].set_yscale("log")
    axes[0].legend(fontsize=7, title="EOS policy", title_fontsize=7)
    return _save(fig, path)


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
    plt = _plt()
    fig, axes = plt.subplots(1, len(benches), figsize=(3.4 * len(benches), 3.4), squeeze=False)
    for ax, b in zip(axes[0], benches):
        for r in rows:
            prof = r["benchmarks"][b]["eos_prob"].get("inside_by_fifth")
            if prof:
                ax.plot(
                    range(1, len(prof) + 1), prof, marker="o", label=f"{r['n_experts']} experts"
                )
        for name, per in singles.items():
            prof = per.get(b, {}).get("inside_by_fifth")
            if prof:
                ax.plot(range(1, len(prof) + 1), prof, ls=":", label=f"{name} expert")
        ax.set_yscale("log")
        ax.set_title(b, fontsize=9)
        ax.set_xlabel("fifth of the reference")
    axes[0][0].set_ylabel("mean p(EOS), teacher-forced")
    axes[0][0].legend(fontsize=6)
    return _save(fig, path)


def remedies(res: dict[str, Any], path: Path) -> Path | None:
    """3 experts: test score per benchmark of the plain composition and each remedy chosen on
    validation, with the share of outputs shorter than the reference."""
    rem = (res.get("remedies") or {}).get("rows")
    if not rem:
        return None
    plt = _plt()
    labels = list(rem)
    benches = list(rem[labels[0]]["benchmarks"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        row = rem[label]
        name = f"{label} (w={row['weight']:g}, {row['eos_policy']})"
        xs = [j + i * width for j in range(len(benches))]
        axes[0].bar(xs, [row["benchmarks"][b]["score"]["mean"] for b in benches], width, label=name)
        short = [row["benchmarks"][b]["premature"].get("shorter_than_reference") for b in benches]
        axes[1].bar(xs, [s if s is not None else 0 for s in short], width)
    for ax, title in zip(axes, ("test score", "share shorter than the reference")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(benches))], benches, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 1.05)
    axes[0].legend(fontsize=6)
    return _save(fig, path)


def diagnostics(res: dict[str, Any], path: Path) -> Path | None:
    """Where the experts are active and co-active, and whether co-activity predicts the gain."""
    diag = {b: d for b, d in (res.get("diagnostics") or {}).items() if "active_fraction" in d}
    if not diag:
        return None
    plt = _plt()
    db = list(diag)
    keys = [f"{t:g}" for t in next(iter(diag.values()))["thresholds"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    width = 0.8 / (2 * len(keys))
    for j, t in enumerate(keys):
        for e, name in enumerate(("math", "code")):
            xs = [i + (2 * j + e) * width for i in range(len(db))]
            axes[0].bar(xs, [diag[b]["active_fraction"][name][t] for b in db], width,
                        label=f"{name}: KL>{t}", color=f"C{2 * j + e}")  # fmt: skip
    axes[0].set_xticks(range(len(db)), db, fontsize=8)
    axes[0].legend(fontsize=6)
    axes[0].set_title("share of tokens where an expert is active", fontsize=9)
    axes[0].set_ylim(0, 1)
    for j, t in enumerate(keys):
        both = [diag[b]["coactive_fraction"]["math&code"][t] for b in db]
        axes[1].bar(
            [i + j * 0.25 for i in range(len(db))], both, 0.25, label=f"both active, KL>{t}"
        )
    differs = [diag[b]["composed_top1_differs_fraction"] for b in db]
    axes[1].plot(
        range(len(db)), differs, "k*", markersize=10, label="composed top-1 differs from all"
    )
    axes[1].set_xticks(range(len(db)), db, fontsize=8)
    axes[1].legend(fontsize=6)
    axes[1].set_title("co-activity (where factorisation fails)", fontsize=9)
    axes[1].set_ylim(0, 1)
    paired = res.get("paired_vs_best_expert", {})
    for b in db:
        if b in paired and "composition" in paired[b]["vs"]:
            x = diag[b]["coactive_fraction"]["math&code"]["0.1"]
            y = paired[b]["vs"]["composition"]["paired_bootstrap"]
            err = [[y["mean_diff"] - y["low"]], [y["high"] - y["mean_diff"]]]
            axes[2].errorbar(x, y["mean_diff"], yerr=err, fmt="o")
            axes[2].annotate(b, (x, y["mean_diff"]), fontsize=8)
    axes[2].axhline(0, color="gray", lw=0.5)
    axes[2].set_xlabel("share of tokens with both experts active (KL>0.1)")
    axes[2].set_ylabel("composition − best expert")
    axes[2].set_title("does co-activity predict the gain?", fontsize=9)
    return _save(fig, path)


FIGURES = {"scores": scores, "quality_cost": quality_cost, "termination": termination,
           "eos_profile": eos_profile, "remedies": remedies, "diagnostics": diagnostics}  # fmt: skip


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
    lines = ["| candidate | " + " | ".join(benches) + " | evals/token | ms/token |",
             "|" + "---|" * (len(benches) + 3)]  # fmt: skip
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
