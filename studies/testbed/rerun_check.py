"""How closely a rerun of the linear testbed reproduces the committed results.

    python studies/linear_testbed.py --out /tmp/rerun --figures /tmp/rerun_figs
    python -m studies.testbed.rerun_check /tmp/rerun/results.csv results/testbed/rerun_check.json

Matches the rows of the rerun's ``results.csv`` to the committed ``results/testbed/results.csv``
by (run, fine-tuning, method, λ, density) and records, per numeric column, the largest absolute difference and
how many rows differ at all; accuracies are compared exactly (they are counts over the same
items), the KL and log-prob columns by their largest difference (training round-off differs
between machines and thread counts).
"""

from __future__ import annotations

import csv
import os
import platform
import sys
from pathlib import Path
from typing import Any

from mergelab.results import json_with_keys, write_json_atomic

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = "results/testbed/results.csv"
KEY = ("run_id", "finetune", "method", "lambda", "density")


def read_rows(path: Path) -> dict[tuple[str, ...], dict[str, str]]:
    """The rows of a results.csv by their key; a key that repeats is an error."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    keyed = {tuple(r[k] for k in KEY): r for r in rows}
    if len(keyed) != len(rows):
        raise ValueError(f"{path}: {len(rows) - len(keyed)} rows repeat a key {KEY}")
    return keyed


def _num(x: str) -> float | None:
    try:
        return float(x)
    except ValueError:
        return None


def compare_rows(committed: dict, rerun: dict) -> dict[str, Any]:
    """Per numeric column: rows compared, rows that differ, largest absolute difference."""
    shared = sorted(set(committed) & set(rerun))
    columns = [c for c in next(iter(committed.values())) if c not in KEY]
    out: dict[str, Any] = {}
    for col in columns:
        diffs = []
        for k in shared:
            a, b = _num(committed[k][col]), _num(rerun[k][col])
            if a is not None and b is not None:
                diffs.append(abs(a - b))
        if diffs:
            out[col] = {
                "rows": len(diffs),
                "rows_differing": sum(d != 0.0 for d in diffs),
                "max_abs_diff": max(diffs),
            }
    return {
        "rows_committed": len(committed),
        "rows_rerun": len(rerun),
        "rows_shared": len(shared),
        "columns": out,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m studies.testbed.rerun_check RERUN.csv OUT.json", file=sys.stderr)
        return 2
    rerun_path, out = Path(argv[0]), Path(argv[1])
    if not rerun_path.is_file():
        print(f"error: {rerun_path}: no such file", file=sys.stderr)
        return 2
    summary = {
        "what": "a rerun of python studies/linear_testbed.py against the committed results.csv",
        "committed": COMMITTED,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        **compare_rows(read_rows(ROOT / COMMITTED), read_rows(rerun_path)),
    }
    write_json_atomic(
        out, summary, indent=1, written_by_mergelab=json_with_keys("committed", "columns")
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
