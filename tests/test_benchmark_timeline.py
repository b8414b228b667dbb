"""benchmarks/merge_timeline.py: its split of a run's wall time, on made-up events and on a real
`mergelab merge` of a tiny synthetic set (which also checks that the engine steps it wraps still
exist)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _benchmarks import benchmark_modules

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def timeline(monkeypatch):
    imported = ("merge_speed", "io_floor")
    with benchmark_modules(monkeypatch, "merge_timeline", imported=imported) as (module,):
        yield module


def test_summarise_splits_the_run_at_the_first_merge_and_the_last_write(timeline):
    record = {
        "times": {"engine_imported": 10.8},
        "events": [
            ["merge", "mergelab-chunks_0", 11.0, 11.5],
            ["merge", "mergelab-chunks_1", 11.1, 11.4],
            ["merge", "MainThread", 11.6, 11.7],
            ["write", "mergelab-writer_0", 11.5, 11.6],
            ["write", "mergelab-writer_0", 11.7, 12.0],
        ],
    }
    parts = timeline.summarise(10.0, 12.5, record)
    assert parts["wall_s"] == pytest.approx(2.5)
    assert parts["start_s"] == pytest.approx(1.0)
    assert parts["imports_s"] == pytest.approx(0.8)
    assert parts["merge_s"] == pytest.approx(1.0)
    assert parts["end_s"] == pytest.approx(0.5)
    assert parts["workers_busy_s"] == pytest.approx(0.8)
    assert parts["in_turn_s"] == pytest.approx(0.1)
    assert parts["writer_busy_s"] == pytest.approx(0.4)
    assert parts["tensors"] == 2


def test_a_real_merge_is_timed_in_its_own_process(timeline, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import merge_speed

    shape = merge_speed.TINY_SHAPE
    folder = tmp_path / "llama-2L"
    merge_speed.write_checkpoint_set(folder, shape)
    work = tmp_path / "outputs"
    work.mkdir()
    parts = timeline.run_once("ties", folder, work)
    n_tensors = len(merge_speed.llama_tensors(shape))
    assert parts["tensors"] == n_tensors
    assert 0 < parts["start_s"] < parts["wall_s"]
    assert parts["merge_s"] > 0 and parts["end_s"] > 0
    assert parts["workers_busy_s"] + parts["in_turn_s"] > 0
    assert (work / "mergelab-ties" / "model.safetensors.index.json").is_file()
    assert not list(work.glob("timeline-*.json"))  # the events file is removed
