"""Per-seed values and a seed-level interval for every result record; the summary files.

The unit of replication is the training seed: within a seed the test strings are scored by the
same trained models, so an interval over strings says nothing about retraining. Each row keeps
its per-seed means and gives a Student-t 95% interval over them, ``mean ± t_{0.975, n-1} ·
sd / √n`` (``n`` seeds, ``sd`` with ``n - 1`` in the denominator), clipped to [0, 1] (a success
rate cannot leave it; other quantities, e.g. log-probabilities, are not clipped). With one seed there is no seed-level interval (NaN). Three seeds give a
wide interval (``t_{0.975, 2}`` = 4.30): that width is the honest statement of what three
training runs can tell.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from mergelab.eval.stats import t_interval
from mergelab.outputs import atomic_output_file
from mergelab.results import json_with_keys, starts_with, write_json_atomic

INTERVAL = "Student-t 95% over per-seed means, clipped to [0, 1]"


def seed_t_interval(
    per_seed: Sequence[float], confidence: float = 0.95, *, rate: bool = True
) -> tuple[float, float]:
    """``(low, high)`` of the t-interval over per-seed values, clipped to [0, 1] if ``rate``."""
    if len(per_seed) < 2:
        return math.nan, math.nan
    low, high = t_interval(per_seed, confidence)
    return (max(0.0, low), min(1.0, high)) if rate else (low, high)


def summarise(runs: list[dict], is_rate: Callable[[str], bool] = lambda metric: True) -> list[dict]:
    """One row per (part, pair, method, metric, x): mean of the per-seed means, interval, per seed.

    ``is_rate(metric)`` says whether a metric is a rate in [0, 1] (its interval is clipped).
    """
    groups: dict[tuple, dict] = defaultdict(lambda: {"by_seed": defaultdict(list), "kind": None})
    for run in runs:
        for r in run["records"]:
            g = groups[(r["part"], r["pair"], r["method"], r["metric"], r["x"])]
            g["by_seed"][r["seed"]] += r["values"]
            g["kind"] = r["kind"]
    rows = []
    for (part, pair, method, metric, x), g in groups.items():
        seeds = sorted(g["by_seed"])
        per_seed = [float(np.mean(g["by_seed"][s])) if g["by_seed"][s] else math.nan for s in seeds]
        low, high = seed_t_interval(per_seed, rate=is_rate(metric))
        row = {"part": part, "pair": pair, "method": method, "kind": g["kind"], "metric": metric}
        row |= {"x": x, "mean": float(np.mean(per_seed)), "ci_low": low, "ci_high": high}
        row |= {"n": sum(len(v) for v in g["by_seed"].values()), "seeds": seeds}
        interval = INTERVAL if is_rate(metric) else INTERVAL.replace(", clipped to [0, 1]", "")
        rows.append(row | {"per_seed": per_seed, "interval": interval})
    return rows


def summary_rows(path: Path) -> bool:
    """Recognises a summary.json this study wrote: a list of summary records."""
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(rows, list) and all(isinstance(r, dict) and "metric" in r for r in rows)


def write_summary(out_dir: Path, rows: list[dict]) -> None:
    header = ",".join(rows[0])  # summary.json holds the same rows: a list of these records
    write_json_atomic(out_dir / "summary.json", rows, indent=1, written_by_mergelab=summary_rows)
    with atomic_output_file(
        out_dir / "summary.csv", written_by_mergelab=starts_with(header)
    ) as tmp:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            for r in rows:
                seeds = " ".join(map(str, r["seeds"]))
                per_seed = " ".join(f"{v:.4f}" for v in r["per_seed"])
                w.writerow({**r, "seeds": seeds, "per_seed": per_seed})


MAIN_PARTS = (
    "authors",
    "generative",
    "generative-shared",
    "shared-full",
    "shared-lora",
    "failure",
    "failure-shared-full",
)


def print_main_table(rows: list[dict]) -> None:
    def pick(part, metric="joint"):
        return [r for r in rows if r["part"] == part and r["metric"] == metric and r["x"] is None]

    print(f"\nJoint exact match at the trained length: mean [{INTERVAL}] (per seed)")
    for part in MAIN_PARTS:
        if not pick(part):
            continue
        print(f"\n== {part}")
        for metric in ("joint", "chain"):
            for r in pick(part, metric):
                ci = f"[{100 * r['ci_low']:5.1f}, {100 * r['ci_high']:5.1f}]"
                seeds = " ".join(f"{100 * v:.1f}" for v in r["per_seed"])
                label = "" if metric == "joint" else " (chain target)"
                print(
                    f"  {r['pair']:<14} {r['method'] + label:<40} {100 * r['mean']:6.1f}  {ci}  ({seeds})"
                )


def is_rate(metric: str) -> bool:
    """Rates in [0, 1] (exact match, error rates, shares), not log-probs, margins or counts."""
    return not metric.startswith(("median", "mean active", "errors (count)"))


def resummarise(path: Path) -> None:
    """Recompute the summary of a results file from its per-seed records (nothing retrained)."""
    result = json.loads(path.read_text())
    write_json_atomic(
        path,
        result | {"summary": summarise(result["runs"], is_rate)},
        indent=1,
        written_by_mergelab=json_with_keys("config", "runs"),
    )


def experiment_parser(description: str, out: Path, sizes: dict) -> argparse.ArgumentParser:
    """The command line shared by the toy experiments: seeds, the results file, smoke-run sizes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--n-train", type=int, default=sizes["n_train"])
    p.add_argument("--n-test", type=int, default=sizes["n_test"])
    p.add_argument("--resummarise", action="store_true", help="only recompute the summary of --out")
    return p
