"""The item-by-item reading of the 2-vs-3-experts rows (studies.llm.three_experts) on a small
fixture shaped like the n = 150 smollm2 files, and its committed output against its inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from studies.llm import three_experts as te

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = "results/llm/three_experts_smollm2.json"
ITEMS = [f"i{k}" for k in range(16)]


def rec(right: set[str], tokens: dict[str, int] | int = 20, limit: set[str] = frozenset()):
    """A termination record: per-item outcomes, stop positions and the mean length."""
    n = {i: tokens if isinstance(tokens, int) else tokens.get(i, 20) for i in ITEMS}
    return {
        "score": {"mean": len(right) / len(ITEMS), "n": len(ITEMS)},
        "cost": {"mean_new_tokens": sum(n.values()) / len(ITEMS)},
        "per_item": {i: float(i in right) for i in ITEMS},
        "per_item_stop": {i: [n[i], "length" if i in limit else "eos"] for i in ITEMS},
    }


TWO_RIGHT = set(ITEMS[:14])  # 2 experts: 14 of 16 right
THREE_RIGHT = set(ITEMS[:2])  # 3 experts: 2 right, so items 2-13 (12) are lost
# how the 12 lost items end with 3 experts: 5 at 4 tokens (before the shortest reference, 10),
# 3 at 12 (before the 2-expert output's 20), 3 at 25, 1 at the token limit
LOST_TOKENS = {
    **{f"i{k}": 4 for k in range(2, 7)},
    **{f"i{k}": 12 for k in range(7, 10)},
    **{f"i{k}": 25 for k in range(10, 13)},
    "i13": 64,
}


def run(seed: int, restoring: bool) -> dict:
    mixed = rec(set(ITEMS[:8]))
    three_math = rec(THREE_RIGHT, LOST_TOKENS, limit={"i13"})
    return {
        "config": {"seed": seed, "scale": "smollm2"},
        "termination": {
            "rows": [
                {
                    "n_experts": 2,
                    "eos_policy": "plain",
                    "benchmarks": {"math": rec(TWO_RIGHT), "mixed": mixed},
                },
                {
                    "n_experts": 3,
                    "eos_policy": "plain",
                    "benchmarks": {"math": three_math, "mixed": mixed},
                },
                # longer, right on the same items as plain: still 12 below 2 experts
                {
                    "n_experts": 3,
                    "eos_policy": "base",
                    "benchmarks": {"math": rec(THREE_RIGHT, 40), "mixed": mixed},
                },
                # shorter than plain
                {
                    "n_experts": 3,
                    "eos_policy": "most_confident",
                    "benchmarks": {"math": rec(THREE_RIGHT, 5), "mixed": mixed},
                },
            ],
            "min_length_rows": [
                {
                    "n_experts": 3,
                    "eos_policy": "plain",
                    "min_new_tokens": {"math": 10, "mixed": 10},
                    "benchmarks": {
                        "math": rec(TWO_RIGHT if restoring else THREE_RIGHT, 30),
                        "mixed": mixed,
                    },
                }
            ],
        },
    }


def test_lost_items_are_split_by_where_the_three_expert_output_stopped():
    out = te.analyse({"s0": run(0, restoring=True)})
    math = out["runs"]["s0"]["benchmarks"]["math"]
    assert (math["drop"]["a_only"], math["drop"]["b_only"]) == (0, 12)
    lost = math["lost"]
    assert lost["n"] == 12
    assert lost["by_end"] == {"stopped_early": 8, "full_length_wrong": 3, "token_limit": 1}
    assert lost["stopped_before_shortest_reference"] == 5
    assert lost["mean_tokens_3_experts"] == pytest.approx((5 * 4 + 3 * 12 + 3 * 25 + 64) / 12)
    assert out["summary"]["lost_items_by_end"] == lost["by_end"]


def test_holm_families_and_the_computed_categories():
    out = te.analyse({"s0": run(0, restoring=True), "s1": run(1, restoring=False)})
    s0, s1 = (out["runs"][s]["benchmarks"]["math"] for s in ("s0", "s1"))
    # the drop family: 4 tests (2 seeds × 2 benchmarks), two with p = 2·0.5¹² → Holm × 4, × 3
    assert s0["drop"]["p_value"] == pytest.approx(2 * 0.5**12)
    assert s0["drop"]["p_holm"] == pytest.approx(4 * 2 * 0.5**12)
    runs0, runs1 = s0["lengthening"], s1["lengthening"]
    assert set(runs0) == {"eos_policy base", "eos_policy most_confident", "min_length"}
    assert runs0["eos_policy base"]["category"] == "lengthens_without_restoring"
    assert runs0["eos_policy most_confident"]["category"] == "does_not_lengthen"
    assert runs0["min_length"]["category"] == "lengthens_and_restores"
    assert runs0["min_length"]["recovered_lost_items"] == 12
    assert runs1["min_length"]["category"] == "lengthens_without_restoring"
    # the gain family: 3 runs × 2 benchmarks × 2 seeds = 12 tests; one gains 12-0
    assert runs0["min_length"]["gain_over_plain"]["p_holm"] == pytest.approx(12 * 2 * 0.5**12)
    assert s0["verdict"] == "lengthening_restores"
    assert s1["verdict"] == "lengthening_does_not_restore"
    assert out["runs"]["s0"]["benchmarks"]["mixed"]["verdict"] == "drop_not_shown"
    assert out["summary"]["verdicts"] == {
        "per_item_not_recorded": 0,
        "drop_not_shown": 2,
        "lengthening_restores": 1,
        "lengthening_does_not_restore": 1,
        "undecided": 0,
    }


def test_files_without_per_item_outcomes_get_the_category_saying_so():
    old = run(0, restoring=True)
    for row in old["termination"]["rows"]:
        for r in row["benchmarks"].values():
            r.pop("per_item", None), r.pop("per_item_stop", None)  # mixed is one shared record
    del old["termination"]["min_length_rows"]
    math = te.analyse({"old": old})["runs"]["old"]["benchmarks"]["math"]
    assert math["verdict"] == "per_item_not_recorded" and "drop" not in math
    assert math["lengthening"]["eos_policy base"] == {
        "score": 2 / 16,
        "tokens": 40.0,
        "category": "lengthens_without_score_gain",
    }
    assert math["lengthening"]["eos_policy most_confident"]["category"] == "does_not_lengthen"
    # from the scores alone: 12 items lost net at least, so p ≥ 2 · 0.5¹²
    assert math["drop_best_case"] == {"net_lost_items": 12, "smallest_possible_p": 2 * 0.5**12}
    assert te.best_case_drop({"mean": 0.5, "n": 20}, {"mean": 0.25, "n": 20}) == {
        "net_lost_items": 5,
        "smallest_possible_p": 0.0625,
    }


def test_cli_writes_once_refuses_bad_input_and_overwrites_only_with_force(tmp_path, capsys):
    f = tmp_path / "results.json"
    f.write_text(json.dumps(run(0, restoring=True)))
    out = tmp_path / "analysis.json"
    assert te.main([str(tmp_path), "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(te.analyse({str(f): run(0, True)})))
    assert te.main([str(f), "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert te.main([str(f), "--out", str(out), "--force"]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"config": {}, "termination": {"rows": []}}))
    assert te.main([str(bad), "--out", str(tmp_path / "x.json")]) == 2
    assert "no 2- and 3-expert plain rows" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_committed_analysis_is_the_analysis_of_the_files_the_findings_use():
    from studies import findings

    committed = json.loads((ROOT / COMMITTED).read_text())
    files = [i["file"] for i in committed["inputs"]]
    _, kind = findings.smollm2_files(ROOT)
    wanted = (
        [findings.SMOLLM2_NEW.format(s) for s in (0, 1, 2)]
        if kind == "new"
        else list(findings.SMOLLM2_OLD)
    )
    assert files == wanted, (
        f"rerun: python -m studies.llm.three_experts {' '.join(wanted)} --out {COMMITTED} --force"
    )
    fresh = te.analyse({f: json.loads((ROOT / f).read_text()) for f in files})
    assert committed == json.loads(json.dumps(fresh)), f"{COMMITTED} is stale"
