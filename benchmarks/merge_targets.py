"""Every ``merge_speed.py`` run against the merge-speed targets, counted from the results files.

    python benchmarks/merge_targets.py                    # print the tables, write the record
    python benchmarks/merge_targets.py --results PATH     # the record elsewhere

Reads each ``benchmarks/results/merge_speed*.json`` that holds a full table (all of
``TARGETS``' rows; the one-variant probes are left out), groups the runs by thread setting
(each tool's default, or both pinned to one thread), orders them by the date of the commit each
measured, and checks every target on every run:

* the TIES family (per-tensor and whole-model trim, sum and count sign rules), DARE-linear,
  DARE-TIES and breadcrumbs within 1.5× mergelab's own linear merge of the same run;
* linear and task arithmetic within 1.3× the run's read-and-write floor (the direct one, which
  reads and writes as mergelab does);
* TIES at least 8× and DARE-TIES at least 3× faster than mergekit, where mergekit ran;
* every method's peak RSS at most mergekit's, where mergekit ran.

The runs that hold the first table, mergekit-format configs at their own dtype
(``mergekit_format_rows``, every config of ``FORMAT_CONFIGS``, at full size), are checked
against that table's targets: every config at least 5× faster than mergekit (wall), every
config but linear within 2× mergelab's own linear merge of the same config (wall), every peak
RSS at most mergekit's.

It prints one Markdown table per thread setting and one for the mergekit-format runs (a ratio
that misses its target is marked ✗) and how many runs met each target, and writes the same as
JSON (``--results``). Nothing is
measured here: every number comes from a results file, so the README's count of met targets is
this script's output, not a hand-kept list.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


class Target(NamedTuple):
    """One checked ratio: ``variant``'s ``field`` in a run, met when at most (``most``) or at
    least (not ``most``) ``bound``; ``label`` heads its column."""

    label: str
    variant: str
    field: str
    bound: float
    most: bool = True

    def met(self, value: float) -> bool:
        return value <= self.bound if self.most else value >= self.bound


TARGETS = [
    Target("ties ÷ linear", "ties", "over_linear", 1.5),
    Target("ties count ÷ linear", "ties_count", "over_linear", 1.5),
    Target("whole-model ties ÷ linear", "ties_model", "over_linear", 1.5),
    Target("whole-model count ÷ linear", "ties_model_count", "over_linear", 1.5),
    Target("dare_linear ÷ linear", "dare_linear", "over_linear", 1.5),
    Target("dare_ties ÷ linear", "dare_ties", "over_linear", 1.5),
    Target("breadcrumbs ÷ linear", "breadcrumbs", "over_linear", 1.5),
    Target("linear ÷ floor", "linear", "over_floor_direct", 1.3),
    Target("task_arithmetic ÷ floor", "task_arithmetic", "over_floor_direct", 1.3),
    Target("ties × mergekit", "ties", "speedup", 8.0, most=False),
    Target("dare_ties × mergekit", "dare_ties", "speedup", 3.0, most=False),
]
RSS_LABEL = "largest RSS ÷ mergekit's"  # every row with mergekit: met when at most 1

# The mergekit-format table (merge_speed.py's first): its configs, and the full size its targets
# are set at (3 × 0.99B parameters; a reduced run, --layers, is left out).
FORMAT_CONFIGS = ["linear", "ties", "dare_ties", "dare_linear", "breadcrumbs"]
FULL_SIZE_PARAMS = 0.9e9
FORMAT_TARGETS = [
    Target(f"{c} × mergekit", c, "speedup", 5.0, most=False) for c in FORMAT_CONFIGS
] + [Target(f"{c} ÷ linear", c, "over_linear", 2.0) for c in FORMAT_CONFIGS if c != "linear"]
FORMAT_LABELS = [t.label for t in FORMAT_TARGETS] + [RSS_LABEL]
FORMAT_BOUNDS = {t.label: t.bound for t in FORMAT_TARGETS} | {RSS_LABEL: 1.0}
LABELS = [t.label for t in TARGETS] + [RSS_LABEL]  # the tables' columns, in order
BOUNDS = {t.label: t.bound for t in TARGETS} | {RSS_LABEL: 1.0}


def commit_date(commit: str | None) -> str:
    """The ISO date of the commit a run measured ("" where the file names none or git does not
    know it: such runs sort first)."""
    if not commit:
        return ""
    sha = commit.split("+")[0]
    done = subprocess.run(
        ["git", "show", "-s", "--format=%cI", sha], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() if done.returncode == 0 else ""


def check_run(path: Path) -> dict | None:
    """One results file's values and verdicts, or None if it is not a full table."""
    record = json.loads(path.read_text())
    rows = {row["variant"]: row for row in record.get("rows", []) if "variant" in row}
    if not all(t.variant in rows for t in TARGETS):
        return None
    return _verdicts(path, record, rows, TARGETS)


def check_format_run(path: Path) -> dict | None:
    """One results file's mergekit-format values and verdicts, or None where it holds no full
    mergekit-format table at full size."""
    record = json.loads(path.read_text())
    rows = {row["variant"]: row for row in record.get("mergekit_format_rows", [])}
    if not all(c in rows for c in FORMAT_CONFIGS):
        return None
    if (record.get("config", {}).get("n_params") or 0) < FULL_SIZE_PARAMS:
        return None
    return _verdicts(path, record, rows, FORMAT_TARGETS)


def _verdicts(path: Path, record: dict, rows: dict[str, dict], targets: list[Target]) -> dict:
    """Each target's value in ``rows`` (a table of ``record``) and whether it is met, with the
    largest peak RSS ÷ mergekit's over the rows (met when at most 1)."""
    config = record.get("config", {})
    values: dict[str, float | None] = {}
    met: dict[str, bool | None] = {}
    for t in targets:
        value = rows[t.variant].get(t.field)
        values[t.label] = value
        met[t.label] = None if value is None else t.met(value)
    rss = [row["rss_ratio"] for row in rows.values() if row.get("rss_ratio") is not None]
    values[RSS_LABEL] = max(rss) if rss else None
    met[RSS_LABEL] = None if not rss else max(rss) <= 1.0
    linear = rows["linear"].get("mergelab") or {}
    return {
        "file": path.name,
        "threads": config.get("threads"),
        "commit": config.get("commit"),
        "date": commit_date(config.get("commit")),
        "cpu": (config.get("cpu") or {}).get("family_model"),
        "linear_s": linear.get("s"),
        "values": values,
        "met": met,
    }


def tally(runs: list[dict], labels: list[str] = LABELS) -> dict[str, dict[str, int]]:
    """Per target: in how many runs it was checked (a value there) and met."""
    return {
        label: {
            "checked": sum(r["met"][label] is not None for r in runs),
            "met": sum(r["met"][label] is True for r in runs),
        }
        for label in labels
    }


def collect(folder: Path = RESULTS) -> dict[str, list[dict]]:
    """The full-table runs under folder, grouped "default" / "threads1", oldest commit first,
    and the full-size mergekit-format runs ("mergekit_format")."""
    groups: dict[str, list[dict]] = {"default": [], "threads1": [], "mergekit_format": []}
    for path in sorted(folder.glob("merge_speed*.json")):
        run = check_run(path)
        if run is not None:
            groups["threads1" if run["threads"] == 1 else "default"].append(run)
        run = check_format_run(path)
        if run is not None:
            groups["mergekit_format"].append(run)
    for runs in groups.values():
        runs.sort(key=lambda r: (r["date"], r["file"]))
    return groups


def group_labels(name: str) -> tuple[list[str], dict[str, float]]:
    """A group's target columns and bounds."""
    return (FORMAT_LABELS, FORMAT_BOUNDS) if name == "mergekit_format" else (LABELS, BOUNDS)


def _cell(value: float | None, met: bool | None, bound: float | None = None) -> str:
    """value to two decimals (three where two would round it onto its bound), ✗ if missed."""
    if value is None:
        return "–"
    text = f"{value:.2f}"
    if bound is not None and float(text) == bound and value != bound:
        text = f"{value:.3f}"
    return text + (" ✗" if met is False else "")


def markdown(runs: list[dict], group: str = "default") -> str:
    """A table of the runs (one row each, misses marked ✗) and a last row of the counts."""
    labels, bounds = group_labels(group)
    head = ["run", "CPU", "linear s", *labels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [f"`{r['file']}`", r["cpu"] or "–", _cell(r["linear_s"], None)]
        cells += [_cell(r["values"][key], r["met"][key], bounds[key]) for key in labels]
        lines.append("| " + " | ".join(cells) + " |")
    counts = tally(runs, labels)
    last = ["met in", "", ""] + [f"{counts[k]['met']} of {counts[k]['checked']}" for k in labels]
    lines.append("| " + " | ".join(last) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=str(RESULTS), help="where the results files are")
    parser.add_argument("--results", default=str(RESULTS / "merge_targets.json"))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    groups = collect(Path(args.folder))
    titles = {
        "default": "Each tool at its default thread count",
        "threads1": "Both on one thread",
        "mergekit_format": "mergekit-format configs at their own dtype (the first table)",
    }
    for name, runs in groups.items():
        print(f"\n{titles[name]} ({len(runs)} runs)\n")
        print(markdown(runs, name))
    rss = {"label": RSS_LABEL, "bound": BOUNDS[RSS_LABEL]}
    record = {
        "targets": [t._asdict() for t in TARGETS] + [rss],
        "mergekit_format_targets": [t._asdict() for t in FORMAT_TARGETS] + [rss],
        "runs": groups,
        "tally": {name: tally(runs, group_labels(name)[0]) for name, runs in groups.items()},
    }
    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
