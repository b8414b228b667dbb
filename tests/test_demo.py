"""`mergelab demo` runs end to end offline and its table is meaningful."""

from __future__ import annotations

import json
import math

from mergelab.cli import main
from mergelab.demo import run_demo
from mergelab.merge import list_merge_methods


def test_demo_merges_with_every_method(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert main(["demo", "--steps", "40", "--threads", "1", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(list_merge_methods()) <= set(rows)
    for method in list_merge_methods():
        assert rows[method]["error"] is None, rows[method]["error"]
        assert all(math.isfinite(rows[method][k]) for k in ("count_loss", "skip_loss"))
        assert method in text
    # each expert learned its own task, and only its own
    assert rows["expert: count"]["count_acc"] > 0.9 > rows["expert: count"]["skip_acc"]
    assert rows["expert: skip"]["skip_acc"] > 0.9 > rows["expert: skip"]["count_acc"]
    # the average of the two experts does better on their tasks than the base
    linear = rows["linear"]
    base = rows["base"]
    assert linear["count_loss"] < base["count_loss"] and linear["skip_loss"] < base["skip_loss"]


def test_demo_is_deterministic():
    a = run_demo(seed=1, steps=5)
    b = run_demo(seed=1, steps=5)
    assert [r.count_loss for r in a] == [r.count_loss for r in b]


def test_demo_output_never_replaces_a_file_it_did_not_write(tmp_path, capsys):
    user_file = tmp_path / "notes.json"
    user_file.write_text('{"mine": true}\n')
    # refused before any training, with and without --force; the file is untouched
    assert main(["demo", "--steps", "1", "--output", str(user_file)]) == 2
    assert main(["demo", "--steps", "1", "--output", str(user_file), "--force"]) == 2
    assert user_file.read_text() == '{"mine": true}\n'
    assert "not a file mergelab wrote" in capsys.readouterr().err
    # an earlier demo output is replaced with --force only
    out = tmp_path / "demo.json"
    assert main(["demo", "--steps", "1", "--output", str(out)]) == 0
    assert main(["demo", "--steps", "1", "--output", str(out)]) == 2
    assert main(["demo", "--steps", "1", "--output", str(out), "--force"]) == 0
