"""Figures of the toy study, one function per figure, drawn from ``summary.json`` rows only.

Each ``fig_*`` function takes the summary rows (and the setting's name for the title) and
returns a matplotlib figure, or ``None`` when the rows hold nothing for it; :func:`draw_all`
saves them (``python studies/toy_letters.py --plot-only`` redraws them all). Error bars and
bands are the summary's seed-level interval (:mod:`.summary`).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from mergelab import figure_style as fs  # noqa: E402
from mergelab.results import save_figure  # noqa: E402

# A family has one colour in every mergelab figure (mergelab.figure_style).
KIND_COLORS = {k: fs.family_color(k) for k in ("base", "expert", "composition", "merge")}
CI = "95% t-interval over seeds"

LENGTH_TITLES = {
    "length-authors": "authors' protocol (aligned, from scratch)",
    "length-shared-full": "aligned, experts = full fine-tunes of base",
    "length-generative": "generative (trained at exactly length 16)",
}
PANEL_TITLES = {
    "authors": "authors' protocol: aligned, all from scratch",
    "generative": "generative (x SEP y EOS), all from scratch",
    "shared-full": "aligned, experts = full fine-tunes of base",
    "shared-lora": "aligned, experts = LoRA fine-tunes of base",
    "generative-shared": "generative, experts = fine-tunes of base",
}


def _err(sel):
    m = np.array([100 * r["mean"] for r in sel])
    return m, np.vstack(
        [m - [100 * r["ci_low"] for r in sel], [100 * r["ci_high"] for r in sel] - m]
    )


def _method_colors(rows):
    """Each row name in its family's colour (the same in every mergelab figure); rows of one
    family are told apart by line style and marker (:func:`_method_styles`)."""
    return {
        r["method"]: KIND_COLORS.get(r["kind"], fs.OTHER_COLOR)
        for r in rows
        if r["x"] is not None and r["kind"] != "diagnostic"
    }


def _method_styles(rows):
    """A line style and marker per row name, distinct within its family."""
    kinds = {}
    for r in rows:
        if r["x"] is not None and r["kind"] != "diagnostic":
            kinds.setdefault(r["kind"], set()).add(r["method"])
    styles = {}
    for methods in kinds.values():
        for i, m in enumerate(sorted(methods)):
            styles[m] = {"ls": ["-", "--", ":", "-."][i % 4], "marker": "osD^v"[i % 5]}
    return styles


def _select(rows, **criteria):
    """The rows whose fields equal every ``criteria`` value."""
    return [r for r in rows if all(r[k] == v for k, v in criteria.items())]


def _n_seeds(rows):
    return max((len(r["seeds"]) for r in rows), default=0)


def fig_letters(rows: list[dict], setting: str):
    """Joint exact match of every row at the trained length, one panel per protocol."""
    colors, n_seeds, err = KIND_COLORS, _n_seeds(rows), _err
    panels = [
        p
        for p in ("authors", "generative", "shared-full", "shared-lora", "generative-shared")
        if any(r["part"] == p for r in rows)
    ]
    fig, axes = fs.panels(len(panels), 4.4, 4.6)
    for ax, part in zip(axes, panels):
        sel = [r for r in rows if r["part"] == part and r["metric"] == "joint" and r["x"] is None]
        sel.sort(
            key=lambda r: (r["pair"], ["base", "expert", "composition", "merge"].index(r["kind"]))
        )
        labels = [f"{r['method']}" + (f"\n[{r['pair']}]" if part == "authors" else "") for r in sel]
        m, e = err(sel)
        ax.barh(range(len(sel)), m, color=[colors[r["kind"]] for r in sel], height=0.75)
        ax.errorbar(m, range(len(sel)), xerr=e, fmt="none", ecolor="#333333", capsize=2, lw=0.8)
        ax.set_yticks(range(len(sel)), labels)
        ax.grid(axis="y", visible=False)
        ax.invert_yaxis()
        ax.set_xlim(0, 105)
        ax.set_xlabel("joint exact match (%)")
        ax.set_title(PANEL_TITLES[part], fontsize=9)
        ax.axvline(100, color="k", lw=0.5, ls=":")
    fig.suptitle(
        "Letter replacement, joint exact match at the trained length 16\n"
        f"({setting}, {n_seeds} seeds, {CI})",
        fontweight="bold",
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="lower center", ncol=4, title="family")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def fig_length(rows: list[dict], setting: str):
    """Joint exact match against input length (trained at 16), one panel per protocol."""
    method_color, method_style = _method_colors(rows), _method_styles(rows)
    parts = [
        p
        for p in ("length-authors", "length-shared-full", "length-generative")
        if any(r["part"] == p for r in rows)
    ]
    if parts:
        fig, axes = fs.panels(len(parts), 4.6, 3.8, sharey=True)
        for ax, part in zip(axes, parts):
            methods = sorted({r["method"] for r in rows if r["part"] == part})
            for method in methods:
                sel = sorted(
                    (
                        r
                        for r in rows
                        if r["part"] == part and r["method"] == method and r["metric"] == "joint"
                    ),
                    key=lambda r: r["x"],
                )
                xs = [r["x"] for r in sel]
                # Distinct line styles keep coinciding curves (often all at 100%) visible.
                style = {**method_style[method], "ms": 3}
                line = ax.plot(
                    xs,
                    [100 * r["mean"] for r in sel],
                    label=method,
                    color=method_color[method],
                    **style,
                )[0]
                ax.fill_between(
                    xs,
                    [100 * r["ci_low"] for r in sel],
                    [100 * r["ci_high"] for r in sel],
                    color=line.get_color(),
                    alpha=0.15,
                )
            ax.axvline(16, color="k", ls=":", lw=0.8)
            ax.text(16.5, 3, "trained length", fontsize=7)
            ax.set_xlabel("input length (characters)")
            ax.set_title(LENGTH_TITLES[part], fontsize=9)
            ax.set_ylabel("joint exact match (%)")
            ax.legend(fontsize=7)
        fig.suptitle(
            f"Length generalisation, A→B + C→D ({setting}, {_n_seeds(rows)} seeds, {CI} bands)",
            fontweight="bold",
        )
        fig.tight_layout()
        return fig
    return None


def fig_spans(rows: list[dict], setting: str):
    """Span skills: joint success and success outside the overlap, against the overlap."""
    colors, err, method_color = KIND_COLORS, _err, _method_colors(rows)
    method_style = _method_styles(rows)
    sp = [r for r in rows if r["part"] == "spans" and r["method"] != "diagnostics"]
    if sp:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, metric in zip(axes, ("joint", "outside overlap")):
            # Outside the overlap only rows that claim both skills are of interest.
            kinds = ("composition", "merge") if metric == "outside overlap" else colors
            for method in sorted({r["method"] for r in sp if r["kind"] in kinds}):
                sel = sorted(
                    (r for r in sp if r["method"] == method and r["metric"] == metric),
                    key=lambda r: r["x"],
                )
                xs = [r["x"] for r in sel]
                m, e = err(sel)
                ax.errorbar(
                    xs,
                    m,
                    yerr=e,
                    ms=4,
                    capsize=3,
                    label=method,
                    color=method_color[method],
                    **method_style[method],
                )
            ax.set_xlabel("letters inside both spans (overlap)")
            ax.set_xticks(range(max(r["x"] for r in sp) + 1))
            ax.set_title(
                {
                    "joint": "joint exact match (both skills, incl. overlap)",
                    "outside overlap": "correct outside the overlap",
                }[metric],
                fontsize=10,
            )
        axes[0].set_ylabel("success (%)")
        axes[1].legend(
            *axes[0].get_legend_handles_labels(),
            fontsize=7,
            title="row",
            title_fontsize=7,
            loc="center left",
            bbox_to_anchor=(1.02, 0.5),
        )
        fig.suptitle(
            "Span skills: shift inside <…>, mirror inside (…) "
            f"({setting}, {_n_seeds(rows)} seeds, {CI})",
            fontweight="bold",
        )
        fig.tight_layout()
        return fig
    return None


def fig_failures(rows: list[dict], setting: str):
    """Conflict, chain and wrong base: what each row writes and how often it is right."""
    err, n_seeds = _err, _n_seeds(rows)

    def pick(part, pair, metric, method):
        sel = _select(rows, part=part, pair=pair, metric=metric, method=method, x=None)
        return sel[0] if sel else None

    fig, axes = plt.subplots(1, 3, figsize=(15, 6.5))
    # (a) conflict A->B with A->C: stacked fractions of the A positions.
    ax = axes[0]
    bars = []
    for part in ("failure", "failure-shared-full"):
        methods = [
            r["method"] for r in _select(rows, part=part, pair="A->B + A->C", metric="A kept")
        ]
        bars += [
            (part, m)
            for m in methods
            if m in ("base", "composition") or part == "failure-shared-full"
        ]
    # Outcomes, not families: Okabe–Ito colours away from the family ones.
    outcome_colors = {"A written as B": "#56B4E9", "A written as C": "#E69F00", "A kept": "0.6"}
    for i, (part, method) in enumerate(bars):
        left = 0.0
        for metric, color in outcome_colors.items():
            r = pick(part, "A->B + A->C", metric, method)
            v = 100 * r["mean"] if r else 0.0
            ax.barh(i, v, left=left, color=color, label=metric if i == 0 else None)
            left += v
        ax.barh(
            i,
            100 - left,
            left=left,
            color="#CC79A7",
            label="other letter" if i == 0 else None,
        )
    ax.set_yticks(
        range(len(bars)),
        [f"{m} ({'scratch' if p == 'failure' else 'fine-tuned'})" for p, m in bars],
        fontsize=7,
    )
    ax.invert_yaxis()
    ax.set_xlabel("% of input A positions")
    ax.set_title("(a) conflict: A→B with A→C — what is written for A", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    # (b) chain A->B with B->C: parallel target (each letter once) vs chain target (A→C).
    ax = axes[1]
    bars = []
    for part in ("failure", "failure-shared-full"):
        methods = [
            r["method"] for r in _select(rows, part=part, pair="A->B + B->C", metric="chain")
        ]
        bars += [(part, m) for m in methods if m != "base"]
    for j, (metric, color, label) in enumerate(
        (
            ("joint", "#CC79A7", "parallel target (A→B, B→C)"),
            ("chain", "#56B4E9", "chain target (A→C, B→C)"),
        )
    ):
        sel = [pick(p, "A->B + B->C", metric, m) for p, m in bars]
        m, e = err(sel)
        ax.barh(
            np.arange(len(sel)) + 0.4 * j - 0.2,
            m,
            height=0.4,
            xerr=e,
            color=color,
            capsize=2,
            label=label,
        )
    ax.set_yticks(
        range(len(bars)),
        [f"{m} ({'scratch' if p == 'failure' else 'fine-tuned'})" for p, m in bars],
        fontsize=7,
    )
    ax.invert_yaxis()
    ax.set_xlim(0, 105)
    ax.set_xlabel("joint exact match (%)")
    ax.set_title("(b) chain: A→B with B→C", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    # (c) wrong base under the A->B, C->D experts (from scratch).
    ax = axes[2]
    sel = [
        r
        for r in rows
        if r["part"] in ("authors", "failure")
        and r["pair"] == "A->B + C->D"
        and r["metric"] in ("joint", "skill A->B", "skill C->D")
        and r["method"].startswith("composition")
    ]
    sel.sort(key=lambda r: (r["method"], r["metric"]))
    m, e = err(sel)
    ax.barh(
        range(len(sel)),
        m,
        xerr=e,
        color=[KIND_COLORS["composition"] if r["metric"] == "joint" else "#f0b088" for r in sel],
        capsize=2,
    )
    ax.set_yticks(range(len(sel)), [f"{r['method']} · {r['metric']}" for r in sel], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 105)
    ax.set_xlabel("success (%)")
    ax.set_title("(c) wrong base: A→B + C→D experts over another base", fontsize=9)
    fig.suptitle(
        f"Failure cases the theory predicts ({setting}, {n_seeds} seeds, {CI})", fontweight="bold"
    )
    fig.tight_layout()
    return fig


def fig_diagnostics(rows: list[dict], setting: str):
    """Per-token co-activity and composed-top-1-differs against composition success."""

    def success_of(r):
        if r["part"] == "spans":
            sel = _select(rows, part="spans", method="composition", metric="joint", x=r["x"])
        else:
            pair, _, wb = r["pair"].partition(" (")
            name = f"composition ({wb[:-1]})" if wb else "composition"
            sel = _select(rows, part=r["part"], pair=pair, method=name, metric="joint", x=None)
        return sel[0] if sel else None

    measures = {
        "co-active@0.1": "co-active positions: both experts have KL(p_i‖p_b) > 0.1 nats (%)",
        "composed top-1 differs": "positions where the composed top-1 differs from every model's (%)",
    }
    cases = [
        r
        for r in rows
        if r["method"] == "diagnostics" and r["metric"] == "co-active@0.1" and success_of(r)
    ]
    if cases:
        fig, axes = plt.subplots(2, 1, figsize=(7.5, 9.5))
        tab20 = plt.get_cmap("tab20")

        def cmap(k):  # the dark half of tab20 first: pale labels are hard to read
            return tab20((2 * k) % 20 + (2 * k // 20) % 2)

        points = {}
        for ax, (metric, xlabel) in zip(axes, measures.items()):
            points[ax] = []
            for i, case in enumerate(cases, 1):
                keys = {k: case[k] for k in ("part", "pair", "x")}
                (r,) = _select(rows, method="diagnostics", metric=metric, **keys)
                s = success_of(case)
                xerr = [[100 * (r["mean"] - r["ci_low"])], [100 * (r["ci_high"] - r["mean"])]]
                yerr = [[100 * (s["mean"] - s["ci_low"])], [100 * (s["ci_high"] - s["mean"])]]
                ax.errorbar(
                    100 * r["mean"],
                    100 * s["mean"],
                    xerr=xerr,
                    yerr=yerr,
                    marker="o",
                    capsize=2,
                    color=cmap((i - 1) % 20),
                )
                name = f"{case['part']} · {case['pair']}"
                points[ax].append((100 * r["mean"], 100 * s["mean"], name, cmap((i - 1) % 20)))
            ax.set_xlabel(xlabel, fontsize=9)
            ax.set_ylabel("composition joint exact match (%)")
            ax.set_ylim(-5, 105)
        axes[0].set_title("co-activity", loc="left")
        axes[1].set_title("composed top-1 differs", loc="left")
        fig.suptitle(
            "Do per-token diagnostics predict composition success?\n"
            f"({setting}, {_n_seeds(rows)} seeds, {CI})",
            fontweight="bold",
        )
        fig.tight_layout()
        for ax, pts in points.items():  # labels beside the axes, placed for the final layout
            fs.label_points(ax, *zip(*pts))
        return fig
    return None


def _rows(result: dict, part: str, metric: str) -> list[dict]:
    return [r for r in result["summary"] if r["part"].startswith(part) and r["metric"] == metric]


def fig_authors_exact(result: dict):
    """The authors' notebook settings: joint exact match against length, every seed."""
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = list(result["runs"][0]["joint_exact_match_by_length"])
    for i, row in enumerate(rows):
        # The product of experts (no base) is no family of its own: the colour of "other".
        family = fs.candidate_family(row)
        color = fs.OTHER_COLOR if row.startswith("product") else fs.family_color(family)
        curves = [
            [
                run["joint_exact_match_by_length"][row][k]
                for k in sorted(run["joint_exact_match_by_length"][row], key=int)
            ]
            for run in result["runs"]
        ]
        xs = range(1, len(curves[0]) + 1)
        for c in curves:
            ax.plot(xs, [100 * v for v in c], color=color, lw=0.6, alpha=0.5)
        mean = [100 * np.mean(v) for v in zip(*curves)]
        ls = ["-", "--", ":", "-.", (0, (5, 1))][i % 5]
        # Curves may coincide (base and product of experts do): later ones drawn thinner on top.
        ax.plot(xs, mean, color=color, lw=max(3.5 - 0.5 * i, 1.2), ls=ls, label=row)
    ax.axvline(result["config"]["train_length"], color="k", ls=":", lw=0.8)
    ax.set(
        xlabel="input length (characters; trained at 16, n_positions 32)",
        ylabel="joint exact match (%)",
    )
    ax.legend(fontsize=7)
    ax.set_title(
        f"Authors' notebook settings: A→B + C→D, {len(result['runs'])} seeds (thin: each seed)",
        fontsize=9,
    )
    return fig


def _bars(ax, rows, label):
    m, e = _err(rows)
    ax.barh(range(len(rows)), m, xerr=e, capsize=2, color=KIND_COLORS["composition"])
    for i, r in enumerate(rows):
        ax.plot([100 * v for v in r["per_seed"]], [i] * len(r["per_seed"]), "k.", ms=4)
    ax.set_yticks(range(len(rows)), [label(r) for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 105)


def fig_explanations(result: dict):
    """Left: the from-scratch generative failure under its controls. Right: wrong and right bases."""
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    em = [
        r
        for r in _rows(result, "generative failure", "exact match")
        if "composition" in r["method"] or "product" in r["method"]
    ]
    em += _rows(result, "generative failure", "share where the product of experts is right")
    _bars(
        axes[0],
        em,
        lambda r: (
            f"{r['pair']} · {r['method']}"
            + (" · share of errors the PoE gets right" if r["metric"].startswith("share") else "")
        ),
    )
    axes[0].set_title(
        "(a) from scratch: composition vs product of experts (teacher-forced error anatomy)",
        fontsize=9,
    )
    _bars(
        axes[1],
        _rows(result, "wrong base", "joint exact match"),
        lambda r: f"{r['pair']} · {r['method']}",
    )
    axes[1].set_title("(b) wrong base: A→B + C→D experts vs the swap variant A↔B + C↔D", fontsize=9)
    for ax in axes:
        ax.set_xlabel(f"% (bars: mean, {CI}; dots: seeds)")
    fig.suptitle(
        f"Composition failures explained ({_n_seeds(result['summary'])} seeds)", fontweight="bold"
    )
    fig.tight_layout()
    return fig


def fig_many_experts(result: dict):
    """Joint exact match against the number of composed experts, per condition."""
    rows = _rows(result, "", "joint exact match")
    conditions = sorted({r["part"] for r in rows})
    fig, axes = fs.panels(len(conditions), 4.0, 3.4, sharey=True)
    for ax, cond in zip(axes, conditions):
        for j, method in enumerate(sorted({r["method"] for r in rows if r["part"] == cond})):
            sel = [r for r in rows if r["part"] == cond and r["method"] == method]
            color = fs.family_color(fs.candidate_family(method))
            ks = sorted({r["x"] for r in sel})
            for r in sel:  # each subset of experts, each seed
                ax.plot(
                    [r["x"] + 0.1 * j] * len(r["per_seed"]),
                    [100 * v for v in r["per_seed"]],
                    ".",
                    color=color,
                    alpha=0.4,
                    ms=4,
                )
            ax.plot(
                [k + 0.1 * j for k in ks],
                [100 * np.mean([r["mean"] for r in sel if r["x"] == k]) for k in ks],
                "-o",
                color=color,
                label=method,
            )
        ax.set(
            title=cond, xlabel="experts composed", xticks=[2, 3, 4], ylabel="joint exact match (%)"
        )
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Many experts ({_n_seeds(rows)} seeds): line = mean over subsets of experts, "
        "dots = subset × seed",
        fontweight="bold",
    )
    fig.tight_layout()
    return fig


FIGURES = {
    "letters": fig_letters,
    "length": fig_length,
    "spans": fig_spans,
    "failures": fig_failures,
    "diagnostics": fig_diagnostics,
}


# The other recipes' results files (in results/toy/) and their figures.
RESULT_FIGURES = {
    "authors_exact": fig_authors_exact,
    "explanations": fig_explanations,
    "many_experts": fig_many_experts,
}


def draw_all(rows: list[dict], prefix: Path, setting: str) -> list[Path]:
    """Draw every figure the summary rows support, as ``{prefix}{name}.png``."""
    with fs.style():
        figs = {name: fig_fn(rows, setting) for name, fig_fn in FIGURES.items()}
        return [save_figure(f, f"{prefix}{n}.png") for n, f in figs.items() if f is not None]


def draw_results(results: Path, prefix: Path) -> list[Path]:
    """Draw the figure of each other recipe whose results file exists in ``results``."""
    written = []
    for name, fig_fn in RESULT_FIGURES.items():
        path = results / f"{name}.json"
        if path.exists():
            with fs.style():
                fig = fig_fn(json.loads(path.read_text()))
                written.append(save_figure(fig, f"{prefix}{name}.png"))
    return written
