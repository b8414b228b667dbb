"""When is task arithmetic logit composition? The linear testbed (docs/composition.md §3).

If logits are linear in the parameters (z = Φ(x)θ), merging θ_b + Σ_i (θ_i − θ_b) gives exactly the
composed distribution p_b · Π_i p_i / p_b. This recipe measures how far that breaks for networks:

1. synthetic factorised next-token tasks (a background task and two experts, each "after trigger b,
   say π_i(b)"), with a knob for how many triggers the experts share (overlap);
2. a base trained by maximum likelihood on the background, experts fine-tuned from it (standard,
   and tangent-space: the linearisation f(θ_b) + J(θ_b)(θ − θ_b));
3. for each model (log-linear; MLP with activation (1−α)·id + α·GELU, depth 1..3) the gap between
   each weight merge (task arithmetic over a λ grid, TIES, linear interpolation) and the logit
   composition of the same experts: mean per-token KL(p_merge ‖ p_composition) in nats over all
   V² contexts, and every candidate's top-1 accuracy on each task.

Results go to results/testbed/ (results.csv: one row per run × fine-tuning × candidate, with its
config and seed; config.json; runs/ holds one file per finished run, so an interrupted study
resumes). Figures are drawn from results.csv alone:

    python studies/linear_testbed.py                 # run (refuses to replace results)
    python studies/linear_testbed.py --force         # recompute and replace
    python studies/linear_testbed.py --plot-only     # redraw figures/testbed_*.png from the files
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mergelab.compose import compose_logprobs
from mergelab.merge import list_merge_methods, merge_models
from mergelab.outputs import OutputExistsError, atomic_output_file
from mergelab.testbed import (
    LinearizedModel,
    all_contexts,
    build_model,
    context_logprobs,
    finetune,
    fit_max_likelihood,
    make_task_family,
    measure_against_composition,
    next_token_counts,
    sample_sequences,
)

CONFIG = {
    # tasks
    "vocab_size": 16,
    "n_experts": 2,
    "triggers_per_expert": 4,
    "boost": 10.0,  # nats added to the expert's target logit on its triggers
    "background_scale": 2.0,  # std of the background's random logits
    "n_sequences": 4096,  # per task (background data for the base, expert data per expert)
    "sequence_length": 32,
    # models and training
    "hidden": 32,
    "activation": "gelu",
    "base_steps": 300,
    "finetune_steps": 200,
    # Adam learning rates per model kind: the convex log-linear fit needs a large step to converge
    # in 200 steps; MLP experts are fine-tuned with a smaller step than their base was trained with.
    "base_lr": {"loglinear": 0.1, "mlp": 0.03},
    "finetune_lr": {"loglinear": 0.1, "mlp": 0.01},
    # merges
    "lambdas": [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0],
    "ties_density": 0.2,
    "ties_lambda": 1.0,
    # the grid
    "alphas": [0.0, 0.25, 0.5, 0.75, 1.0],
    "depths": [1, 2, 3],
    "tangent_alphas": [0.0, 1.0],  # tangent-space experts are fitted at these α (all depths)
    "overlaps": [0.0, 0.25, 0.5, 0.75, 1.0],
    "overlap_model": {"depth": 2, "alpha": 1.0},  # the MLP of the overlap study
}
SEEDS = [0, 1, 2]
FIGURES = {
    "nonlinearity": "testbed_gap_vs_nonlinearity.png",
    "overlap": "testbed_gap_vs_overlap.png",
    "tangent": "testbed_linear_tangent_standard.png",
}


@dataclass(frozen=True)
class RunSpec:
    """One base + experts: the model, the task family's overlap, the seed, which fine-tunings."""

    model: str  # "loglinear" | "mlp"
    depth: int  # hidden layers (0 for log-linear)
    alpha: float  # activation = (1 − α)·identity + α·GELU
    overlap: float
    seed: int
    finetunes: tuple[str, ...]  # ("standard",) or ("standard", "tangent")

    @property
    def run_id(self) -> str:
        return (
            f"{self.model}_d{self.depth}_a{self.alpha:g}_o{self.overlap:g}_s{self.seed}"
            f"_{'+'.join(self.finetunes)}"
        )


def plan_runs(cfg: dict, seeds: list[int]) -> list[RunSpec]:
    """Every run the three figures need, each once (the overlap-0 runs are shared)."""
    runs: dict[str, RunSpec] = {}
    for seed in seeds:
        specs = [RunSpec("loglinear", 0, 0.0, o, seed, ("standard",)) for o in cfg["overlaps"]]
        for depth in cfg["depths"]:
            for alpha in cfg["alphas"]:
                tangent = alpha in cfg["tangent_alphas"]
                fts = ("standard", "tangent") if tangent else ("standard",)
                specs.append(RunSpec("mlp", depth, alpha, 0.0, seed, fts))
        om = cfg["overlap_model"]
        for o in cfg["overlaps"]:
            if o != 0.0:
                specs.append(RunSpec("mlp", om["depth"], om["alpha"], o, seed, ("standard",)))
        for s in specs:
            runs.setdefault(s.run_id, s)
    return list(runs.values())


def run_one(cfg: dict, spec: RunSpec) -> list[dict]:
    """Train a base and experts for ``spec``; one row per (fine-tuning, candidate)."""
    V = cfg["vocab_size"]
    family = make_task_family(
        vocab_size=V,
        n_experts=cfg["n_experts"],
        triggers_per_expert=cfg["triggers_per_expert"],
        overlap=spec.overlap,
        boost=cfg["boost"],
        background_scale=cfg["background_scale"],
        seed=spec.seed,
    )
    # Data depends on (seed, overlap) only, so all models of one seed see the same sequences.
    g = torch.Generator().manual_seed(1_000_003 * spec.seed + 17)
    n, T = cfg["n_sequences"], cfg["sequence_length"]
    contexts = all_contexts(V)
    base_counts = next_token_counts(
        sample_sequences(family.background_logits, n, T, generator=g), V
    )
    expert_counts = [
        next_token_counts(sample_sequences(logits, n, T, generator=g), V)
        for logits in family.expert_logits
    ]

    base = build_model(
        spec.model,
        V,
        depth=spec.depth,
        hidden=cfg["hidden"],
        alpha=spec.alpha,
        activation=cfg["activation"],
        seed=spec.seed,
    )
    fit_max_likelihood(
        base, contexts, base_counts, steps=cfg["base_steps"], lr=cfg["base_lr"][spec.model]
    )

    rows = []
    for kind in spec.finetunes:
        tangent = kind == "tangent"
        experts = [
            finetune(
                base,
                contexts,
                counts,
                steps=cfg["finetune_steps"],
                lr=cfg["finetune_lr"][spec.model],
                tangent=tangent,
            )
            for counts in expert_counts
        ]
        # Tangent experts are merged and composed around the linearised base (= f(θ_b) at θ_b).
        reference = LinearizedModel(base) if tangent else base
        base_lp = context_logprobs(reference, V)
        expert_lps = [context_logprobs(e, V) for e in experts]
        composition = compose_logprobs(base_lp, expert_lps)  # the paper's rule, w_i = 1

        candidates: list[tuple[str, float | None, torch.Tensor]] = [
            ("base", None, base_lp),
            *[(f"expert_{i}", None, lp) for i, lp in enumerate(expert_lps)],
            ("composition", None, composition),
        ]
        for lam in cfg["lambdas"]:
            merged = merge_models(
                "task_arithmetic", reference, experts, params={"lambda_": lam}, dtype=torch.float64
            )
            candidates.append(("task_arithmetic", lam, context_logprobs(merged, V)))
        if "ties" in list_merge_methods():
            merged = merge_models(
                "ties",
                reference,
                experts,
                params={"density": cfg["ties_density"], "lambda_": cfg["ties_lambda"]},
                dtype=torch.float64,
            )
            candidates.append(("ties", cfg["ties_lambda"], context_logprobs(merged, V)))
        merged = merge_models("linear", reference, experts, dtype=torch.float64)
        candidates.append(("linear", None, context_logprobs(merged, V)))

        for method, lam, lp in candidates:
            rows.append(
                {
                    **asdict(spec),
                    "finetunes": "+".join(spec.finetunes),
                    "run_id": spec.run_id,
                    "finetune": kind,
                    "method": method,
                    "lambda": lam,
                    "density": cfg["ties_density"] if method == "ties" else None,
                    **measure_against_composition(lp, composition, family),
                }
            )
    return rows


def run_study(cfg: dict, seeds: list[int], out_dir: Path, *, force: bool) -> Path:
    """Run (or resume) every planned run; write results.csv and config.json into ``out_dir``."""
    results_csv = out_dir / "results.csv"
    if results_csv.exists() and not force:
        raise OutputExistsError(
            f"{results_csv} exists; pass --force to recompute it, or --plot-only to redraw figures"
        )
    if "ties" not in list_merge_methods():
        print(
            "warning: merge method 'ties' is not registered yet; TIES rows are skipped",
            file=sys.stderr,
        )
    runs_dir = out_dir / "runs"
    specs = plan_runs(cfg, seeds)
    rows, started = [], time.time()
    for spec in tqdm(specs, desc="testbed runs", unit="run"):
        path = runs_dir / f"{spec.run_id}.json"
        if path.exists() and not force:
            saved = json.loads(path.read_text())
            if saved["config"] == cfg:  # resume only runs made with this exact config
                rows += saved["rows"]
                continue
        run_rows = run_one(cfg, spec)
        with atomic_output_file(path, force=True) as tmp:
            tmp.write_text(json.dumps({"config": cfg, "spec": asdict(spec), "rows": run_rows}))
        rows += run_rows

    fields = list(rows[0])
    with atomic_output_file(results_csv, force=True) as tmp:
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    meta = {
        "study": "linear_testbed",
        "config": cfg,
        "seeds": seeds,
        "n_runs": len(specs),
        "merge_methods_available": list_merge_methods(),
        "ties_included": "ties" in list_merge_methods(),
        "seconds": round(time.time() - started, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "kl_definition": "mean over all V*V contexts (uniform) of KL(p_candidate || p_composition), nats",
    }
    with atomic_output_file(out_dir / "config.json", force=True) as tmp:
        tmp.write_text(json.dumps(meta, indent=2))
    return results_csv


# ----------------------------------------------------------------------------------------------
# Figures: drawn from results.csv (and config.json for labels) only.


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
def _is(method: str, lam: float | None = None):
    return lambda r: r["method"] == method and (lam is None or r["lambda"] == lam)


MERGE_CURVES = [
    ("task arithmetic λ=1", _is("task_arithmetic", 1.0), "tab:blue", "o-"),
    ("task arithmetic λ=0.5", _is("task_arithmetic", 0.5), "tab:cyan", "s--"),
    ("TIES (density 0.2, λ=1)", _is("ties"), "tab:red", "^-"),
    (
        "linear interpolation (mean; = task arith. λ=½ for 2 experts)",
        _is("linear"),
        "tab:green",
        "x:",
    ),
]
ROUNDOFF_FLOOR = 1e-18  # KLs at or below this are float64 round-off; drawn at the floor


def _loglinear_roundoff(rows) -> float:
    """Largest |KL| between task arithmetic λ=1 and composition over the log-linear runs."""
    sel = [r for r in rows if r["model"] == "loglinear" and _is("task_arithmetic", 1.0)(r)]
    return max((abs(r["kl_to_composition"]) for r in sel), default=math.nan)


def _select(rows, **where):
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
    std = _select(rows, model="mlp", finetune="standard", overlap=0.0)
    fig, axes = plt.subplots(
        3, len(cfg["depths"]), figsize=(4.6 * len(cfg["depths"]), 11.5), squeeze=False
    )
    for col, depth in enumerate(cfg["depths"]):
        ax_gap, ax_acc, ax_bg = axes[0, col], axes[1, col], axes[2, col]
        rows_d = _select(std, depth=depth)
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
            "tab:purple",
            "d-.",
        )
        comp = [r for r in rows_d if r["method"] == "composition"]
        base = [r for r in rows_d if r["method"] == "base"]
        for ax, key in ((ax_acc, "acc_experts_mean"), (ax_bg, "acc_background")):
            _band(
                ax,
                _by_seed(comp, lambda r, key=key: r["alpha"], lambda r, key=key: 100 * r[key]),
                "logit composition",
                "black",
                "*-",
            )
        _band(
            ax_bg,
            _by_seed(base, lambda r: r["alpha"], lambda r: 100 * r["acc_background"]),
            "base model",
            "gray",
            ".:",
        )
        ax_gap.set_yscale("log")
        ax_gap.set_title(f"MLP, depth {depth}")
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
    )
    fig.tight_layout(rect=(0, 0.055, 1, 1))
    _save(fig, path)


def plot_overlap(rows, meta, path: Path):
    import matplotlib.pyplot as plt

    cfg = meta["config"]
    om = cfg["overlap_model"]
    n_seeds = len(meta["seeds"])
    mlp = _select(rows, model="mlp", finetune="standard", depth=om["depth"], alpha=om["alpha"])
    loglin = _select(rows, model="loglinear", finetune="standard")
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
        ("MLP: logit composition", [r for r in mlp if r["method"] == "composition"], "black", "*-"),
        (
            "MLP: task arithmetic λ=1",
            [r for r in mlp if _is("task_arithmetic", 1.0)(r)],
            "tab:blue",
            "o-",
        ),
        ("MLP: TIES", [r for r in mlp if r["method"] == "ties"], "tab:red", "^-"),
        (
            "MLP: single expert (own task)",
            [r for r in mlp if r["method"] == "expert_0"],
            "tab:orange",
            "v--",
        ),
        (
            "log-linear: composition = task arithmetic λ=1",
            [r for r in loglin if r["method"] == "composition"],
            "gray",
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
    )
    fig.tight_layout()
    _save(fig, path)


def plot_tangent(rows, meta, path: Path):
    import matplotlib.pyplot as plt

    cfg = meta["config"]
    n_seeds = len(meta["seeds"])
    ta = [r for r in rows if _is("task_arithmetic", 1.0)(r) and r["overlap"] == 0.0]
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
        ("standard fine-tuning", "standard", "tab:red", -0.12),
        ("tangent-space fine-tuning", "tangent", "tab:blue", 0.12),
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
    )
    fig.tight_layout()
    _save(fig, path)


def _save(fig, path: Path):
    import matplotlib.pyplot as plt

    with atomic_output_file(path, force=True) as tmp:
        fig.savefig(tmp, dpi=130, format="png")
    plt.close(fig)


def plot_all(out_dir: Path, figures_dir: Path) -> list[Path]:
    """Draw the three figures from ``out_dir``/results.csv and config.json only."""
    import matplotlib

    matplotlib.use("Agg")
    rows, meta = load_rows(out_dir)
    paths = [figures_dir / FIGURES[k] for k in ("nonlinearity", "overlap", "tangent")]
    plot_nonlinearity(rows, meta, paths[0])
    plot_overlap(rows, meta, paths[1])
    plot_tangent(rows, meta, paths[2])
    return paths


def summarise(out_dir: Path) -> None:
    """Print the headline numbers (mean over seeds) from results.csv."""
    rows, meta = load_rows(out_dir)

    def mean(rs, key):
        return sum(r[key] for r in rs) / len(rs) if rs else math.nan

    print("gap = mean KL(p_merge || p_composition) [nats]; acc = mean expert-task top-1 [%]")
    for model, depth, alpha, ft in [("loglinear", 0, 0.0, "standard")] + [
        ("mlp", d, a, ft)
        for d in meta["config"]["depths"]
        for a in (0.0, 1.0)
        for ft in ("standard", "tangent")
    ]:
        rs = _select(rows, model=model, depth=depth, alpha=alpha, finetune=ft, overlap=0.0)
        if not rs:
            continue
        parts = []
        for name, pick in [
            ("TA1", _is("task_arithmetic", 1.0)),
            ("TIES", _is("ties")),
            ("linear", _is("linear")),
        ]:
            sel = [r for r in rs if pick(r)]
            if sel:
                parts.append(
                    f"{name} gap {mean(sel, 'kl_to_composition'):.3g} acc {100 * mean(sel, 'acc_experts_mean'):.0f}"
                )
        comp = [r for r in rs if r["method"] == "composition"]
        parts.append(
            f"comp acc {100 * mean(comp, 'acc_experts_mean'):.0f} bg {100 * mean(comp, 'acc_background'):.0f}"
        )
        print(f"{model:9s} d={depth} α={alpha:g} {ft:8s} | " + " | ".join(parts))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/testbed"), help="results folder")
    ap.add_argument("--figures", type=Path, default=Path("figures"), help="figures folder")
    ap.add_argument("--seeds", type=int, nargs="+", default=SEEDS)
    ap.add_argument("--force", action="store_true", help="recompute and replace existing results")
    ap.add_argument("--plot-only", action="store_true", help="only redraw figures from --out")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.plot_only:
        run_study(CONFIG, args.seeds, args.out, force=args.force)
    for p in plot_all(args.out, args.figures):
        print(f"wrote {p}")
    summarise(args.out)


if __name__ == "__main__":
    main()
