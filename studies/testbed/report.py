"""The linear testbed's headline numbers, read from results/testbed/results.csv only."""

from __future__ import annotations

import math
from pathlib import Path

from studies.testbed.figures import is_candidate, load_rows, select


def summarise(out_dir: Path) -> dict:
    """Print the headline numbers (mean over seeds) from results.csv and return them."""
    rows, meta = load_rows(out_dir)
    cfg = meta["config"]

    def mean(rs, key):
        return sum(r[key] for r in rs) / len(rs) if rs else math.nan

    print("gap = mean KL(p_merge || p_composition) [nats]; acc = mean expert-task top-1 [%]")
    for model, depth, alpha, ft in [("loglinear", 0, 0.0, "standard")] + [
        ("mlp", d, a, ft)
        for d in cfg["depths"]
        for a in (0.0, 1.0)
        for ft in ("standard", "tangent")
    ]:
        rs = select(rows, model=model, depth=depth, alpha=alpha, finetune=ft, overlap=0.0)
        if not rs:
            continue
        parts = []
        for name, method, lam in [
            ("TA1", "task_arithmetic", 1.0),
            ("TIES", "ties", None),
            ("linear", "linear", None),
        ]:
            sel = [r for r in rs if is_candidate(method, lam)(r)]
            gap, acc = mean(sel, "kl_to_composition"), 100 * mean(sel, "acc_experts_mean")
            parts.append(f"{name} gap {gap:.3g} acc {acc:.0f}")
        comp = [r for r in rs if r["method"] == "composition"]
        acc, bg = 100 * mean(comp, "acc_experts_mean"), 100 * mean(comp, "acc_background")
        parts.append(f"comp acc {acc:.0f} bg {bg:.0f}")
        print(f"{model:9s} d={depth} α={alpha:g} {ft:8s} | " + " | ".join(parts))

    # Which λ of the grid is closest to the composition, run by run (standard fine-tuning).
    closest: dict[str, int] = {}
    for run_id in sorted({r["run_id"] for r in rows}):
        ta = [r for r in rows if r["run_id"] == run_id and r["finetune"] == "standard"]
        ta = [r for r in ta if r["method"] == "task_arithmetic"]
        best = min(ta, key=lambda r: r["kl_to_composition"])
        closest[f"{best['lambda']:g}"] = closest.get(f"{best['lambda']:g}", 0) + 1
    print("task-arithmetic λ closest to the composition (runs, standard fine-tuning):", closest)

    # Composition's accuracy on the experts' tasks against the ceiling, by overlap.
    om = cfg["overlap_model"]
    by_overlap = {}
    for model, where in (("mlp", {"depth": om["depth"], "alpha": om["alpha"]}), ("loglinear", {})):
        comp = select(rows, model=model, finetune="standard", method="composition", **where)
        for overlap in sorted({r["overlap"] for r in comp}):
            rs = [r for r in comp if r["overlap"] == overlap]
            acc, ceil = mean(rs, "acc_experts_mean"), mean(rs, "acc_experts_ceiling")
            by_overlap[f"{model} overlap {overlap:g}"] = {"acc": acc, "ceiling": ceil}
            print(
                f"composition, {model}, overlap {overlap:g}: {100 * acc:.1f}% of items, "
                f"ceiling {100 * ceil:.1f}%, {100 * acc / ceil:.1f}% of the ceiling"
            )
    return {"closest_lambda_runs": closest, "composition_vs_ceiling": by_overlap}
