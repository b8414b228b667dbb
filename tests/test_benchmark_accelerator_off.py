"""benchmarks/accelerator_off.py on a tiny synthetic set: both ways run, each in its own process
with the switch as asked, and the results file says they wrote the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _benchmarks import benchmark_modules

from mergelab.merge.accelerator import kernels

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    imported = ("merge_speed", "io_floor")
    with benchmark_modules(monkeypatch, "accelerator_off", imported=imported) as (module,):
        yield module


@pytest.mark.slow  # about 90 s here: it holds the package's files in memory as the real run does
@pytest.mark.skipif(not kernels.available(), reason="the compiled loops are not built")
def test_both_ways_run_and_write_the_same_bytes(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MERGELAB_ACCELERATOR", raising=False)
    import merge_speed

    monkeypatch.setattr(bench, "LLAMA_SHAPE", merge_speed.TINY_SHAPE)  # the set it makes
    results = tmp_path / "off.json"
    argv = ["--variants", "ties", "--repeats", "1", "--layers", "2"]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--results", str(results)]
    assert bench.main(argv) == 0
    record = json.loads(results.read_text())
    row = record["summary"]["ties"]
    assert row["same_bytes"] is True
    assert row["on_median_cpu_s"] > 0 and row["off_median_cpu_s"] > 0
    assert set(record["config"]["import_rss_mib"]) == {"on", "off"}
    assert len(record["runs"]["ties"]["on"]) == len(record["runs"]["ties"]["off"]) == 1


def test_the_architecture_pages_table_equals_its_results_file():
    """docs/architecture.md's "accelerator off" table: every cell is the results file's."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## The accelerator off, measured") :]
    section = section[: section.index("\n## ")]
    summary = json.loads((ROOT / "benchmarks/results/accelerator_off.json").read_text())["summary"]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    shown = {row.split("|")[1].split()[0]: row for row in rows[1:]}
    assert set(shown) == set(summary)
    for variant, x in summary.items():
        cells = [c.strip() for c in shown[variant].split("|")[2:-1]]
        assert x["same_bytes"] is True
        assert cells == [
            f"{x['on_median_cpu_s']:.1f} ({x['on_median_s']:.1f})",
            f"{x['off_median_cpu_s']:.1f} ({x['off_median_s']:.1f})",
            f"{x['median_cpu_off_over_on']:.1f}×",
            f"{x['on_peak_rss_mib']} / {x['off_peak_rss_mib']} MiB",
            f"{x['on_rss_above_import_in_largest_f32']:.1f} / "
            f"{x['off_rss_above_import_in_largest_f32']:.1f}",
        ], variant
    after = json.loads((ROOT / "benchmarks/results/accelerator_off_pass_buffers.json").read_text())[
        "summary"
    ]["ties_model"]
    assert after["same_bytes"] is True
    before_mib = summary["ties_model"]["off_peak_rss_mib"]
    assert f"from {before_mib} to {after['off_peak_rss_mib']} MiB" in section
