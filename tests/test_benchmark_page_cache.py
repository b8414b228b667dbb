"""The merge benchmark's page-cache helpers (benchmarks/merge_speed.py, page_cache_hold.py): what
they hold, what they find a tool loads, and what they count as resident."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _benchmarks import benchmark_modules

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    names = ("merge_speed", "page_cache_hold")
    with benchmark_modules(monkeypatch, *names) as modules:
        yield dict(zip(names, modules))


def test_resident_maps_every_readable_file_and_skips_the_rest(bench, tmp_path):
    files = []
    for i, size in enumerate((5000, 0, 70_000)):
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(b"x" * size)
    held = bench["merge_speed"].Resident([*files, tmp_path / "missing"])
    assert held.summary() == {"files": 2, "mib": 0}
    assert held.bytes == 75_000
    assert [m[:1] for m in held.maps] == [b"x", b"x"]


def test_tool_files_lists_what_the_probe_imported(bench, monkeypatch):
    speed = bench["merge_speed"]
    monkeypatch.setattr(speed, "TOOL_IMPORTS", {"json": "import json", "absent": "import no_such"})
    files = speed.tool_files(speed.tool_env(None))
    assert Path(json.__file__).resolve() in files
    assert all(f.is_file() for f in files)
    assert any(f.suffix == ".so" or ".so." in f.name for f in files)  # mapped libraries too


def test_resident_bytes_counts_pages_in_the_page_cache(bench, tmp_path):
    path = tmp_path / "data"
    path.write_bytes(b"\1" * (3 * 4096 + 5))
    path.read_bytes()  # just written and read: in the page cache
    counted = bench["page_cache_hold"].resident_bytes([path])
    assert counted == path.stat().st_size
