"""The linear testbed's figures, each drawn from results/testbed/results.csv and config.json only."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from mergelab import figure_style as fs
from mergelab.results import save_figure

FIGURES = {
    "nonlinearity": "testbed_gap_vs_nonlinearity.png",
    "overlap": "testbed_gap_vs_overlap.png",
    "tangent": "testbed_linear_tangent_standard.png",
}


def load_rows(out_dir: Path) -> tuple[list[dict], dict]:
    with open(out_dir / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for key in ("depth", "seed"):
            r[key] = int(r[key])
        for key in ("alpha", "overlap", "kl_to_composition", "max_abs_logprob_diff"):
            r[key] = float(r[key])
        for key in [k for k in r if k.startswith("acc_")]:
            r[key] = float(r[key])
        r["lambda"] = float(r["lambda"]) if r["lambda"] not in ("", "None") else None
    meta = json.loads((out_dir / "config.json").read_text())
    return rows, meta


# What a weight-merge curve is called in the figures, and how a row is picked for it.
def is_candidate(method: str, lam: float | None = None):
    return lambda r: r["method"] == method and (lam is None or r["lambda"] == lam)


# Merges in shades of the merge family's colour, told apart by marker and line style too.
MERGE_SHADES = fs.family_shades("merge", 5)
MERGE_CURVES = [
    ("task arithmetic λ=1", is_candidate("task_arithmetic", 1.0), MERGE_SHADES[0], "o-"),
    ("task arithmetic λ=0.5", is_candidate("task_arithmetic", 0.5), MERGE_SHADES[3], "s--"),
    ("TIES (density 0.2, λ=1)", is_candidate("ties"), MERGE_SHADES[1], "^-"),
    (
        "linear interpolation (mean; = task arith. λ=½ for 2 experts)",
        is_candidate("linear"),
        MERGE_SHADES[2],
        "x:",
    ),
]
COMPOSITION = fs.family_color("composition")
BASE = fs.family_color("base")
EXPERT = fs.family_color("expert")
ROUNDOFF_FLOOR = 1e-18  # KLs at or below this are float64 round-off; drawn at the floor


def _loglinear_roundoff(rows) -> float:
    """Largest |KL| between task arithmetic λ=1 and composition over the log-linear runs."""
    sel = [r for r in rows if r["model"] == "loglinear" and is_candidate("task_arithmetic", 1.0)(r)]
    return max((abs(r["kl_to_composition"]) for r in sel), default=math.nan)


def select(rows, **where):
    return [r for r in rows if all(r[k] == v for k, v in where.items())]


def _by_seed(rows, key_fn, value_fn):
    """{x: [value per seed]} for the rows, with x = key_fn(row)."""
    out: dict = {}
    for r in rows:
        out.setdefault(key_fn(r), []).append(value_fn(r))
    return dict(sorted(out.items()))


def _best_lambda_kl(rows, group_keys):
    """Per (group, seed): the task-arithmetic λ in the grid whose KL to the composition is least."""
    best: dict = {}
    for r in rows:
        if r["method"] != "task_arithmetic":
            continue
        k = tuple(r[g] for g in group_keys) + (r["seed"],)
        if k not in best or r["kl_to_composition"] < best[k]["kl_to_composition"]:
            best[k] = r
    return list(best.values())


def _band(ax, xs_to_vals, label, color, style, floor=None):
    """Mean across seeds as a line; min–max across seeds as a band."""
    xs = list(xs_to_vals)
    vals = [xs_to_vals[x] for x in xs]
    clip = (lambda v: max(v, floor)) if floor is not None else (lambda v: v)
    mean = [clip(sum(v) / len(v)) for v in vals]
    lo = [clip(min(v)) for v in vals]
    hi = [clip(max(v)) for v in vals]
    ax.plot(xs, mean, style, color=color, label=label, lw=1.8, ms=5)
    ax.fill_between(xs, lo, hi, color=color, alpha=0.18, lw=0)


def plot_nonlinearity(rows, meta, path: Path):
    import matplotlib.pyplot as plt

    cfg = meta["config"]
    n_seeds = len(meta["seeds"])
    std = select(rows, model="mlp", finetune="standard", overlap=0.0)
    fig, axes = plt.subplots(
        3, len(cfg["depths"]), figsize=(4.6 * len(cfg["depths"]), 11.5), squeeze=False
    )
    for col, depth in enumerate(cfg["depths"]):
        ax_gap, ax_acc, ax_bg = axes[0, col], axes[1, col], axes[2, col]
        rows_d = select(std, depth=depth)
        for label, pick, color, style in MERGE_CURVES:
            chosen = [r for r in rows_d if pick(r)]
            if not chosen:
                continue
            _band(
                ax_gap,
                _by_seed(chosen, lambda r: r["alpha"], lambda r: r["kl_to_composition"]),
                label,
                color,
                style,
            )
            _band(
                ax_acc,
                _by_seed(chosen, lambda r: r["alpha"], lambda r: 100 * r["acc_experts_mean"]),
                label,
                color,
                style,
            )
            _band(
                ax_bg,
                _by_seed(chosen, lambda r: r["alpha"], lambda r: 100 * r["acc_background"]),
                label,
                color,
                style,
            )
        best = _best_lambda_kl(rows_d, ("alpha",))
        chosen_lambdas = ", ".join(f"{v:g}" for v in sorted({r["lambda"] for r in best}))
        _band(
            ax_gap,
            _by_seed(best, lambda r: r["alpha"], lambda r: r["kl_to_composition"]),
            f"task arithmetic, λ in grid closest to composition (chosen: {chosen_lambdas})"
            if col == 0
            else None,
            MERGE_SHADES[4],
            "d-.",
        )
        comp = [r for r in rows_d if r["method"] == "composition"]
        base = [r for r in rows_d if r["method"] == "base"]
        for ax, key in ((ax_acc, "acc_experts_mean"), (ax_bg, "acc_background")):
            _band(
                ax,
                _by_seed(comp, lambda r, key=key: r["alpha"], lambda r, key=key: 100 * r[key]),
                "logit composition",
                COMPOSITION,
                "*-",
            )
        _band(
            ax_bg,
            _by_seed(base, lambda r: r["alpha"], lambda r: 100 * r["acc_background"]),
            "base model",
            BASE,
            ".:",
        )
        ax_gap.set_yscale("log")
        ax_gap.set_title(f"MLP, depth {depth}: gap to composition")
        ax_acc.set_title(f"MLP, depth {depth}: experts' tasks")
        ax_bg.set_title(f"MLP, depth {depth}: background task")
        for ax in (ax_gap, ax_acc, ax_bg):
            ax.set_xlabel("non-linearity α  (activation = (1−α)·identity + α·GELU)")
            ax.grid(alpha=0.3, which="both")
        ax_acc.set_ylim(0, 100)
        ax_bg.set_ylim(0, 100)
    axes[0, 0].set_ylabel("gap to composition:\nmean KL(p_merge ‖ p_composition)  [nats]")
    axes[1, 0].set_ylabel("accuracy on the experts' tasks  [%]\n(top-1, mean of the experts)")
    axes[2, 0].set_ylabel("accuracy on the background task  [%]\n(top-1, contexts no expert owns)")
    handles = {}
    for ax in (axes[0, 0], axes[1, 0], axes[2, 0]):
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=3, fontsize=9)
    fig.suptitle(
        "Weight merges vs logit composition as the MLP gets less linear (2 experts, disjoint supports)\n"
        f"log-linear model for reference: task arithmetic λ=1 gap ≤ {_loglinear_roundoff(rows):.0e} nats "
        f"(round-off); line = mean, band = min–max over {n_seeds} seeds",
        fontsize=11,
        fontweight="bold",
    )
    fig.tight_layout(rect=(0, 0.055, 1, 1))
    save_figure(fig, path, dpi=130, tight=False)


def plot_overlap(rows, meta, path: Path):
    import matplotlib.pyplot as plt

    cfg = meta["config"]
    om = cfg["overlap_model"]
    n_seeds = len(meta["seeds"])
    mlp = select(rows, model="mlp", finetune="standard", depth=om["depth"], alpha=om["alpha"])
    loglin = select(rows, model="loglinear", finetune="standard")
    fig, (ax_gap, ax_acc, ax_bg) = plt.subplots(1, 3, figsize=(18, 5.2))
    for label, pick, color, style in MERGE_CURVES:
        chosen = [r for r in mlp if pick(r)]
        if chosen:
            _band(
                ax_gap,
                _by_seed(chosen, lambda r: r["overlap"], lambda r: r["kl_to_composition"]),
                f"MLP: {label}",
                color,
                style,
            )
    ax_gap.set_ylim(bottom=0)
    ax_gap.set_xlabel("support overlap ρ  (fraction of trigger tokens the experts share)")
    ax_gap.set_ylabel("gap to composition: mean KL(p_merge ‖ p_composition)  [nats]")
    ax_gap.set_title(
        f"Gap vs overlap (MLP depth {om['depth']}, α={om['alpha']:g})\n"
        f"log-linear model: task arithmetic λ=1 gap ≤ {_loglinear_roundoff(loglin):.0e} nats at every ρ",
        fontsize=10,
    )
    ax_gap.grid(alpha=0.3, which="both")
    ax_gap.legend(fontsize=8, loc="center right")

    curves = [
        (
            "MLP: logit composition",
            [r for r in mlp if r["method"] == "composition"],
            COMPOSITION,
            "*-",
        ),
        (
            "MLP: task arithmetic λ=1",
            [r for r in mlp if is_candidate("task_arithmetic", 1.0)(r)],
            MERGE_SHADES[0],
            "o-",
        ),
        ("MLP: TIES", [r for r in mlp if r["method"] == "ties"], MERGE_SHADES[1], "^-"),
        (
            "MLP: single expert (own task)",
            [r for r in mlp if r["method"] == "expert_0"],
            EXPERT,
            "v--",
        ),
        (
            "log-linear: composition = task arithmetic λ=1",
            [r for r in loglin if r["method"] == "composition"],
            fs.OTHER_COLOR,
            "o:",
        ),
    ]
    for label, chosen, color, style in curves:
        if not chosen:
            continue
        value = (
            (lambda r: 100 * r["acc_expert_0"])
            if "single expert" in label
            else (lambda r: 100 * r["acc_experts_mean"])
        )
        _band(ax_acc, _by_seed(chosen, lambda r: r["overlap"], value), label, color, style)
        if "single expert" not in label:
            _band(
                ax_bg,
                _by_seed(chosen, lambda r: r["overlap"], lambda r: 100 * r["acc_background"]),
                label,
                color,
                style,
            )
    ceiling = [r for r in mlp if r["method"] == "composition" and "acc_experts_ceiling" in r]
    if ceiling:
        _band(
            ax_acc,
            _by_seed(ceiling, lambda r: r["overlap"], lambda r: 100 * r["acc_experts_ceiling"]),
            "ceiling: best any one next-token distribution can do",
            fs.FLOOR_COLOR,
            "--",
        )
    ax_bg.set_ylim(0, 100)
    ax_bg.set_xlabel("support overlap ρ  (fraction of trigger tokens the experts share)")
    ax_bg.set_ylabel("accuracy on the background task  [%]  (top-1)")
    ax_bg.set_title("Background behaviour kept")
    ax_bg.grid(alpha=0.3)
    ax_bg.legend(fontsize=8, loc="lower left")
    ax_acc.set_ylim(0, 100)
    ax_acc.set_xlabel("support overlap ρ  (fraction of trigger tokens the experts share)")
    ax_acc.set_ylabel("accuracy on the experts' tasks  [%]  (top-1)")
    ax_acc.set_title("Skills kept as the experts' supports overlap")
    ax_acc.grid(alpha=0.3)
    ax_acc.legend(fontsize=8, loc="center left")
    fig.suptitle(
        f"Support overlap between experts (line = mean, band = min–max over {n_seeds} seeds)",
        fontsize=11,
        fontweight="bold",
    )
    fig.tight_layout()
    save_figure(fig, path, dpi=130, tight=False)


def plot_tangent(rows, meta, path: Path):
    import matplotlib.pyplot as plt

    cfg = meta["config"]
    n_seeds = len(meta["seeds"])
    ta = [r for r in rows if is_candidate("task_arithmetic", 1.0)(r) and r["overlap"] == 0.0]
    comp = [r for r in rows if r["method"] == "composition" and r["overlap"] == 0.0]
    alpha = max(cfg["tangent_alphas"])
    labels = ["log-linear"] + [f"MLP d={d}" for d in cfg["depths"]]

    def pick(rs, model, depth, finetune):
        if model == "loglinear":
            return [r for r in rs if r["model"] == "loglinear"]
        return [
            r
            for r in rs
            if r["model"] == "mlp"
            and r["depth"] == depth
            and r["alpha"] == alpha
            and r["finetune"] == finetune
        ]

    series = [
        # Both are task arithmetic λ=1 (merge family); fine-tuning kinds, not families.
        ("standard fine-tuning", "standard", MERGE_SHADES[0], -0.12),
        ("tangent-space fine-tuning", "tangent", fs.OTHER_COLOR, 0.12),
    ]
    fig, (ax_gap, ax_acc, ax_bg) = plt.subplots(1, 3, figsize=(18, 5.2))
    for name, ft, color, dx in series:
        for panel, value in (
            (ax_gap, "kl"),
            (ax_acc, "acc_experts_mean"),
            (ax_bg, "acc_background"),
        ):
            xs, mean, lo, hi = [], [], [], []
            for x in range(len(labels)):
                model, depth = ("loglinear", 0) if x == 0 else ("mlp", cfg["depths"][x - 1])
                if model == "loglinear" and ft == "tangent":
                    continue  # a log-linear model is its own linearisation
                sel_ta, sel_comp = pick(ta, model, depth, ft), pick(comp, model, depth, ft)
                if not sel_ta:
                    continue
                if value == "kl":
                    vals = [max(r["kl_to_composition"], ROUNDOFF_FLOOR) for r in sel_ta]
                else:  # accuracy lost by merging instead of composing, paired by seed
                    c = {r["seed"]: r[value] for r in sel_comp}
                    vals = [100 * (c[r["seed"]] - r[value]) for r in sel_ta]
                m = sum(vals) / len(vals)
                xs.append(x + dx)
                mean.append(m)
                lo.append(m - min(vals))
                hi.append(max(vals) - m)
            panel.errorbar(
                xs, mean, yerr=[lo, hi], fmt="o", color=color, capsize=4, ms=7, label=name
            )
    ax_gap.axhspan(
        ROUNDOFF_FLOOR / 2, 1e-15, color="gray", alpha=0.15, label="float64 round-off (≤ 1e-15)"
    )
    ax_gap.set_yscale("log")
    ax_gap.set_ylabel("gap: mean KL(p_task-arith. λ=1 ‖ p_composition)  [nats]")
    ax_gap.set_title("Task arithmetic (λ=1) vs logit composition")
    ax_acc.axhline(0, color="gray", lw=1)
    ax_acc.set_ylabel(
        "expert-task accuracy lost by merging\n(composition − task arithmetic λ=1)  [% points]"
    )
    ax_acc.set_title("What the gap costs on the experts' tasks")
    ax_bg.axhline(0, color="gray", lw=1)
    ax_bg.set_ylabel(
        "background-task accuracy lost by merging\n(composition − task arithmetic λ=1)  [% points]"
    )
    ax_bg.set_title("What the gap costs on the background task")
    for ax in (ax_gap, ax_acc, ax_bg):
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel(f"model (MLPs at α={alpha:g}: GELU)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Linear vs tangent-space vs standard fine-tuning (mean; bars = min–max over {n_seeds} seeds; "
        f"values ≤ {ROUNDOFF_FLOOR:g} drawn at {ROUNDOFF_FLOOR:g})",
        fontsize=11,
        fontweight="bold",
    )
    fig.tight_layout()
    save_figure(fig, path, dpi=130, tight=False)


def plot_all(out_dir: Path, figures_dir: Path) -> list[Path]:
    """Draw the three figures from ``out_dir``/results.csv and config.json only."""
    import matplotlib

    matplotlib.use("Agg")
    rows, meta = load_rows(out_dir)
    paths = [figures_dir / FIGURES[k] for k in ("nonlinearity", "overlap", "tangent")]
    with fs.style():
        plot_nonlinearity(rows, meta, paths[0])
        plot_overlap(rows, meta, paths[1])
        plot_tangent(rows, meta, paths[2])
    return paths
