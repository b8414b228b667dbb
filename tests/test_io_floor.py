"""The merge benchmark's read-and-write floor (benchmarks/io_floor.py) leaves what was in its
output folder alone: it writes into a folder of its own there and deletes only that."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]


def load_io_floor():
    spec = importlib.util.spec_from_file_location("io_floor", ROOT / "benchmarks" / "io_floor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_the_floor_touches_nothing_it_did_not_create(tmp_path, mode):
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.ones(3000)}, model / "model.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    (out / "floor.bin").write_bytes(b"mine")
    (out / "notes.txt").write_text("keep")
    load_io_floor().io_floor([model], 10_000, out, mode=mode)
    assert sorted(p.name for p in out.iterdir()) == ["floor.bin", "notes.txt"]
    assert (out / "floor.bin").read_bytes() == b"mine"
    assert (out / "notes.txt").read_text() == "keep"
