"""benchmarks/threshold_share.py: a merge whose per-tensor thresholds are replayed from a record
writes the same output as the merge itself, and a wrong record shows (which also checks that
the engine steps the script wraps still exist)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def share(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = importlib.import_module("threshold_share")
    import merge_speed

    folder = tmp_path / "llama-2L"
    merge_speed.write_checkpoint_set(folder, merge_speed.TINY_SHAPE)
    work = tmp_path / "outputs"
    work.mkdir()
    yield module, merge_speed, folder, work
    for name in ("threshold_share", "merge_speed", "io_floor"):
        sys.modules.pop(name, None)


def test_replayed_thresholds_give_the_same_merge(share):
    module, merge_speed, folder, work = share
    assert module.run_variant("ties", folder, work, "record") > 0
    record = json.loads((work / "thresholds-ties.json").read_text())
    names = {json.loads(k)[0] for k in record}  # every tensor's, once
    assert names == {n for n, _ in merge_speed.llama_tensors(merge_speed.TINY_SHAPE)}
    out = merge_speed.mergelab_command("ties", folder, work)[1]
    module.run_variant("ties", folder, work, "replay", out=work / "replay")
    assert module.same_output(out, work / "replay")


def test_a_wrong_record_changes_the_output(share):
    module, merge_speed, folder, work = share
    module.run_variant("ties", folder, work, "record")
    cache = work / "thresholds-ties.json"
    record = json.loads(cache.read_text())
    cache.write_text(json.dumps({k: [[v / 2 for v in vs] for vs in r] for k, r in record.items()}))
    module.run_variant("ties", folder, work, "replay", out=work / "replay")
    assert not module.same_output(
        merge_speed.mergelab_command("ties", folder, work)[1], work / "replay"
    )


def test_linear_finds_no_thresholds(share):
    module, _, folder, work = share
    module.run_variant("linear", folder, work, "record")
    assert json.loads((work / "thresholds-linear.json").read_text()) == {}
