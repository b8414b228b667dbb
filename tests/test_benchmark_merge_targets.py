"""benchmarks/merge_targets.py: every target checked on every full results table, at the bounds
the issue sets. (The README's performance numbers are checked against their results file in
tests/test_docs.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _benchmarks import benchmark_modules

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def targets(monkeypatch):
    with benchmark_modules(monkeypatch, "merge_targets") as (module,):
        yield module


def full_run(targets, over_linear=1.2, speedup=20.0, rss_ratio=0.2, threads="each tool's default"):
    """A results file's record with every variant the targets read, all values given."""
    rows = []
    for variant in {t.variant for t in targets.TARGETS}:
        rows.append(
            {
                "variant": variant,
                "over_linear": 1.0 if variant == "linear" else over_linear,
                "over_floor_direct": 1.1,
                "speedup": speedup,
                "rss_ratio": rss_ratio,
                "mergelab": {"s": 2.5},
            }
        )
    return {"config": {"threads": threads, "commit": None}, "rows": rows}


def write(folder: Path, name: str, record: dict) -> None:
    (folder / name).write_text(json.dumps(record))


def test_each_bound_is_met_at_itself_and_missed_just_past_it(targets, tmp_path):
    at = full_run(targets, over_linear=1.5, speedup=8.0, rss_ratio=1.0)
    past = full_run(targets, over_linear=1.5001, speedup=2.99, rss_ratio=1.01)
    write(tmp_path, "merge_speed_at.json", at)
    write(tmp_path, "merge_speed_past.json", past)
    runs = {r["file"]: r for r in targets.collect(tmp_path)["default"]}
    assert all(runs["merge_speed_at.json"]["met"].values())
    missed = {k for k, v in runs["merge_speed_past.json"]["met"].items() if v is False}
    ratio_labels = {t.label for t in targets.TARGETS if t.field == "over_linear"}
    speed_labels = {t.label for t in targets.TARGETS if t.field == "speedup"}
    assert missed == ratio_labels | speed_labels | {targets.RSS_LABEL}
    # the cell shows a third decimal where two would put a miss on its bound
    table = targets.markdown([runs["merge_speed_past.json"]])
    assert "1.500 ✗" in table and "1.50 |" not in table


def test_runs_without_mergekit_are_not_counted_for_its_targets(targets, tmp_path):
    alone = full_run(targets)
    for row in alone["rows"]:
        row["speedup"] = row["rss_ratio"] = None
    write(tmp_path, "merge_speed_alone.json", alone)
    write(tmp_path, "merge_speed_both.json", full_run(targets, speedup=5.0))
    counts = targets.tally(targets.collect(tmp_path)["default"])
    # only the run with mergekit counts, and its 5× misses 8×
    assert counts["ties × mergekit"] == {"checked": 1, "met": 0}
    assert counts["dare_ties × mergekit"] == {"checked": 1, "met": 1}
    assert counts[targets.RSS_LABEL] == {"checked": 1, "met": 1}
    assert counts["ties ÷ linear"] == {"checked": 2, "met": 2}


def test_partial_tables_are_left_out_and_thread_settings_kept_apart(targets, tmp_path):
    probe = full_run(targets)
    probe["rows"] = [r for r in probe["rows"] if r["variant"] == "dare_ties"]
    write(tmp_path, "merge_speed_probe.json", probe)
    write(tmp_path, "merge_speed_threads1_x.json", full_run(targets, over_linear=1.7, threads=1))
    write(tmp_path, "merge_speed_x.json", full_run(targets))
    write(tmp_path, "loop_costs.json", {"rows": []})  # another benchmark's file
    groups = targets.collect(tmp_path)
    assert [r["file"] for r in groups["default"]] == ["merge_speed_x.json"]
    assert [r["file"] for r in groups["threads1"]] == ["merge_speed_threads1_x.json"]
    assert targets.tally(groups["threads1"])["breadcrumbs ÷ linear"]["met"] == 0


def format_run(targets, over_linear=1.5, speedup=10.0, rss_ratio=0.2, n_params=993_647_616):
    """A results file's record with a full mergekit-format table (and no float32 table)."""
    rows = [
        {
            "variant": c,
            "over_linear": 1.0 if c == "linear" else over_linear,
            "speedup": speedup,
            "rss_ratio": rss_ratio,
            "mergelab": {"s": 1.6},
        }
        for c in targets.FORMAT_CONFIGS
    ]
    config = {"threads": "each tool's default", "commit": None, "n_params": n_params}
    return {"config": config, "rows": [], "mergekit_format_rows": rows}


def test_mergekit_format_targets_at_their_bounds(targets, tmp_path):
    """The first table's targets: ≥ 5× mergekit for every config, ≤ 2× mergelab's own linear for
    every other config, RSS ≤ mergekit's; met at the bounds, missed just past them; a reduced
    run (fewer layers) and a float32-only run are not in this group."""
    write(tmp_path, "merge_speed_at.json", format_run(targets, 2.0, 5.0, 1.0))
    write(tmp_path, "merge_speed_past.json", format_run(targets, 2.001, 4.99, 1.01))
    write(tmp_path, "merge_speed_reduced.json", format_run(targets, n_params=67_000_000))
    write(tmp_path, "merge_speed_float32.json", full_run(targets))
    groups = targets.collect(tmp_path)
    runs = {r["file"]: r for r in groups["mergekit_format"]}
    assert set(runs) == {"merge_speed_at.json", "merge_speed_past.json"}
    assert all(runs["merge_speed_at.json"]["met"].values())
    assert not any(runs["merge_speed_past.json"]["met"].values())
    labels = set(runs["merge_speed_at.json"]["met"])
    assert labels == {f"{c} × mergekit" for c in targets.FORMAT_CONFIGS} | {
        f"{c} ÷ linear" for c in targets.FORMAT_CONFIGS if c != "linear"
    } | {targets.RSS_LABEL}
    assert [r["file"] for r in groups["default"]] == ["merge_speed_float32.json"]
    table = targets.markdown(groups["mergekit_format"], "mergekit_format")
    assert "2.001 ✗" in table and "| met in |" in table
