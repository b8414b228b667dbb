"""Wall time of ``mergelab --help`` (the top-level help), this tree against another.

    python benchmarks/cli_help_time.py OUT.json [--other /path/to/other/tree] [--runs 7]

Each run is a fresh interpreter, ``python -m mergelab.cli --help`` with PYTHONPATH set to the
tree (``mergelab.cli``: the module trees before ``mergelab/__main__.py`` have too). Writes the
median and every run, with the commits and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def timings(tree: Path, runs: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "mergelab.cli", "--help"],
            env=env,
            cwd=tree,
            check=True,
            capture_output=True,
        )
        out.append(time.perf_counter() - started)
    return out


def commit(tree: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True)
    return done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="results JSON to write")
    parser.add_argument("--other", help="another tree to time the same way (e.g. main)")
    parser.add_argument("--runs", type=int, default=7, help="runs per tree (default 7)")
    args = parser.parse_args()
    trees = {"this": HERE, **({"other": Path(args.other).resolve()} if args.other else {})}
    results = {}
    for label, tree in trees.items():
        runs = timings(tree, args.runs)
        results[label] = {
            "tree": str(tree),
            "commit": commit(tree),
            "median_seconds": statistics.median(runs),
            "seconds": runs,
        }
    record = {
        "command": "python -m mergelab.cli --help",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "python": sys.version.split()[0],
        "results": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    for label, r in results.items():
        print(f"{label} ({r['commit'][:7]}): median {r['median_seconds']:.2f} s")


if __name__ == "__main__":
    main()
