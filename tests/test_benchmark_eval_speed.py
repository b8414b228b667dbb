"""benchmarks/eval_speed.py on a tiny setting: every path runs on lm-eval's tasks (local data),
mergelab's outputs equal lm-eval's ``hf`` model's, and the results file holds what the docs cite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _benchmarks import benchmark_modules

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def eval_speed(monkeypatch):
    with benchmark_modules(monkeypatch, "eval_speed") as (module,):
        yield module


def test_tiny_run_times_every_path_with_identical_outputs(eval_speed, tmp_path):
    out = tmp_path / "eval_speed.json"
    argv = ["--items", "3", "--batch-size", "2", "--max-new-tokens", "4", "--hidden-size", "32"]
    argv += ["--layers", "1", "--repeats", "1", "--out", str(out)]
    assert eval_speed.main(argv) == 0
    record = json.loads(out.read_text())
    gen, ll = record["results"]["gen"], record["results"]["ll"]
    assert set(gen) == {
        "hf",
        "mergelab_lm_eval",
        "mergelab_eval",
        "compose_lm_eval",
        "compose_eval",
    }
    assert set(ll) == {"hf", "mergelab_lm_eval", "compose_lm_eval"}
    for rows in (gen, ll):
        assert rows["hf"]["ratio_to_hf"] == 1.0
        for r in rows.values():
            assert r["seconds"] > 0 and r["seconds_per_item"] == pytest.approx(r["seconds"] / 3)
            assert r["tokens_per_second"] == pytest.approx(r["tokens"] / r["seconds"])
            assert 0 < r["cpu_seconds"] and r["cpu_ratio_to_hf"] > 0
    # Greedy: at most 4 tokens per item, every path; 3 items × 4 choices scored.
    assert 0 < gen["hf"]["tokens"] <= 3 * 4
    assert ll["hf"]["tokens"] == ll["compose_lm_eval"]["tokens"] > 3 * 4
    assert set(record["parity"].values()) == {1.0}  # same texts and log-likelihoods as hf
    assert record["targets"]["composition_max_ratio"] == record["targets"]["composition_models"] + 1
    assert set(record["targets_met"]) == {
        f"{t}/{p}" for t, rows in record["results"].items() for p in rows if p != "hf"
    }
    assert all(set(met) == {"wall", "cpu"} for met in record["targets_met"].values())


def test_bad_arguments_exit_2(eval_speed, tmp_path, capsys):
    assert eval_speed.main(["--items", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert "--items must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
