"""mergelab.results: atomic JSON, figures, resume only when the configuration matches."""

import json

import pytest

from mergelab.outputs import ForeignOutputError, OutputExistsError
from mergelab.results import (
    fingerprint,
    json_with_keys,
    load_if_config_matches,
    save_figure,
    starts_with,
    write_json_atomic,
)


def test_json_round_trip_and_no_leftovers(tmp_path):
    path = tmp_path / "deep" / "seed_0.json"
    write_json_atomic(path, {"config": {"lr": 0.1, "sizes": (1, 2)}, "rows": ["α"]})
    assert json.loads(path.read_text(encoding="utf-8"))["rows"] == ["α"]
    write_json_atomic(path, {"config": 1})  # replaced by default
    assert json.loads(path.read_text()) == {"config": 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["seed_0.json"]
    with pytest.raises(OutputExistsError):
        write_json_atomic(path, {}, force=False)
    with pytest.raises(TypeError):  # not JSON-able: the old file stays as it was
        write_json_atomic(path, {"config": object()})
    assert json.loads(path.read_text()) == {"config": 1}


def test_resume_only_when_the_config_matches(tmp_path):
    path = tmp_path / "run.json"
    config = {"lr": 0.1, "sizes": (1, 2)}
    assert load_if_config_matches(path, config) is None  # missing
    write_json_atomic(path, {"config": config, "rows": [1]})
    assert load_if_config_matches(path, config) == {
        "config": {"lr": 0.1, "sizes": [1, 2]},
        "rows": [1],
    }
    assert load_if_config_matches(path, {**config, "lr": 0.2}) is None  # stale
    assert load_if_config_matches(path, config, key="settings") is None  # no such entry
    path.write_text("{truncated")
    assert load_if_config_matches(path, config) is None
    path.write_text("[1, 2]")
    assert load_if_config_matches(path, config) is None


def test_save_figure(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = save_figure(fig, tmp_path / "figs" / "line.png")
    assert path.read_bytes().startswith(b"\x89PNG") and fig.number not in plt.get_fignums()
    fig, _ = plt.subplots()
    assert save_figure(fig, tmp_path / "f.pdf", close=False).read_bytes().startswith(b"%PDF")
    assert fig.number in plt.get_fignums()
    plt.close(fig)


def test_fingerprint_ignores_key_order():
    assert fingerprint({"a": 1, "b": [2]}) == fingerprint({"b": [2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


def test_a_rerun_replaces_its_own_results_and_nothing_else(tmp_path):
    ours = json_with_keys("config", "runs")
    own, foreign = tmp_path / "own.json", tmp_path / "notes.json"
    write_json_atomic(own, {"config": 1, "runs": []}, written_by_mergelab=ours)
    write_json_atomic(own, {"config": 2, "runs": [1]}, written_by_mergelab=ours)  # a rerun
    assert json.loads(own.read_text()) == {"config": 2, "runs": [1]}
    for content in ('{"config": 1}', "[1, 2]", "not json", ""):
        foreign.write_text(content)
        with pytest.raises(ForeignOutputError, match="notes.json"):
            write_json_atomic(foreign, {"config": 3, "runs": []}, written_by_mergelab=ours)
        assert foreign.read_text() == content
    table = tmp_path / "table.md"
    table.write_text("Test score (%), seeds 0\n")
    assert starts_with("Test score (%)")(table) and not starts_with("| candidate")(table)
