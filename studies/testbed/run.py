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
resumes). Figures are drawn from results.csv alone (``studies/testbed/figures.py``):

    python studies/linear_testbed.py                 # run (refuses to replace results)
    python studies/linear_testbed.py --force         # recompute and replace
    python studies/linear_testbed.py --plot-only     # redraw figures/testbed_*.png from the files
"""

from __future__ import annotations

import argparse
import csv
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mergelab.compose import compose_logprobs
from mergelab.merge import list_merge_methods, merge_models
from mergelab.outputs import OutputExistsError, atomic_output_file, check_output_file
from mergelab.results import load_if_config_matches, write_json_atomic
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
from studies.testbed.figures import plot_all
from studies.testbed.files import study_file
from studies.testbed.report import summarise

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


def experts_accuracy_ceiling(triggers: tuple[tuple[int, ...], ...]) -> float:
    """The best mean accuracy over the experts' tasks that one next-token distribution can reach.

    Expert i's accuracy is uniform over its contexts (any first token, last token in S_i). Experts
    that share a trigger ask for different tokens there, so the top-1 token serves at most one of
    them: per trigger, the best choice is the owner whose task weighs it most (1/|S_i|).
    """
    n = len(triggers)
    tokens = {b for s in triggers for b in s}
    return sum(max(1 / len(s) for s in triggers if b in s) for b in tokens) / n


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

    ceiling = experts_accuracy_ceiling(family.triggers)
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
                    "acc_experts_ceiling": ceiling,
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
    owned = {name: study_file(name) for name in ("results.csv", "config.json", "summary.json")}
    for name, recognised in owned.items():  # refused before any work, never after
        check_output_file(out_dir / name, force=True, written_by_mergelab=recognised)
    runs_dir = out_dir / "runs"
    specs = plan_runs(cfg, seeds)
    rows, started = [], time.time()
    for spec in tqdm(specs, desc="testbed runs", unit="run"):
        path = runs_dir / f"{spec.run_id}.json"
        saved = None if force else load_if_config_matches(path, cfg)
        if saved is not None:  # resume only runs made with this exact config
            rows += saved["rows"]
            continue
        run_rows = run_one(cfg, spec)
        record = {"config": cfg, "spec": asdict(spec), "rows": run_rows}
        write_json_atomic(path, record, ensure_ascii=True, written_by_mergelab=study_file("run"))
        rows += run_rows

    fields = list(rows[0])
    with atomic_output_file(results_csv, written_by_mergelab=owned["results.csv"]) as tmp:
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
        "seconds": round(time.time() - started, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "kl_definition": "mean over all V*V contexts (uniform) of KL(p_candidate || p_composition), nats",
    }
    write_json_atomic(
        out_dir / "config.json",
        meta,
        indent=2,
        ensure_ascii=True,
        written_by_mergelab=owned["config.json"],
    )
    return results_csv


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
    summary = summarise(args.out)
    if not args.plot_only:
        write_json_atomic(
            args.out / "summary.json",
            summary,
            indent=2,
            ensure_ascii=True,
            written_by_mergelab=study_file("summary.json"),
        )


if __name__ == "__main__":
    main()
