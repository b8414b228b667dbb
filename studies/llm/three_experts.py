"""Why does a third expert lower accuracy? The 2-vs-3-experts rows of the study read item by item.

    python -m studies.llm.three_experts results/llm/smollm2/results.json \\
        results/llm/smollm2_seed1/results.json --out results/llm/three_experts_smollm2.json

Reads each run's ``termination`` block (nothing is recomputed or generated) and, per seed and
benchmark, asks three questions with the numbers that answer them:

1. **Is there a drop?** The plain 3-expert composition against the plain 2-expert one on the same
   items (exact McNemar; Holm over every seed × benchmark).
2. **How did the lost items end?** For each item right with 2 experts and wrong with 3, where the
   3-expert output stopped (``per_item_stop``): by EOS before the length of the (correct)
   2-expert output — *stopped early*, and of those, before the benchmark's shortest reference
   solution (certainly before its own reference ends) —; as long as the 2-expert output or longer
   — *full-length wrong content*; or at the token limit.
3. **Does lengthening restore accuracy?** Every lengthening run of 3 experts — the other EOS
   policies (``base``, ``most_confident``, …) and the run with EOS ruled out until the shortest
   reference (``min_length_rows``) — against the plain 3-expert run (does it gain?) and against
   the plain 2-expert run (does it stay below?), exact McNemar, each family Holm-corrected over
   every seed × benchmark × run; with how much longer its outputs are and how many lost items it
   recovers.

Each seed × benchmark gets a computed ``verdict`` (:data:`VERDICTS`), and ``summary`` counts them.
Where the files lack what a question needs (the old n = 40 smollm2 runs kept no per-item outcomes
for these rows), the answer is the category saying so, with the aggregate numbers that exist.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from mergelab.eval.stats import holm, mcnemar_exact
from mergelab.outputs import ForeignOutputError, OutputExistsError
from mergelab.results import json_with_keys, write_json_atomic

ALPHA = 0.05

LOST_CATEGORIES = {
    "stopped_early": "ended by EOS (or a stop string) before the length of the correct 2-expert "
    "output",
    "full_length_wrong": "ended by EOS (or a stop string) at or beyond the length of the correct "
    "2-expert output",
    "token_limit": "ran into the token limit",
}

RUN_CATEGORIES = {
    "lengthens_and_restores": "longer than the plain 3-expert outputs, significantly more "
    "accurate than them and not significantly below 2 experts (Holm)",
    "lengthens_without_restoring": "longer than the plain 3-expert outputs and still "
    "significantly below 2 experts (Holm)",
    "lengthens_undecided": "longer than the plain 3-expert outputs; neither of the two above",
    "does_not_lengthen": "not longer than the plain 3-expert outputs (mean generated tokens)",
    # from the scores alone, where per-item outcomes were not recorded
    "lengthens_without_score_gain": "longer than the plain 3-expert outputs, and its score is "
    "not above theirs (scores only: no per-item outcomes)",
    "lengthens_gain_untested": "longer than the plain 3-expert outputs and scores higher; no "
    "per-item outcomes to test it",
}

VERDICTS = {
    "per_item_not_recorded": "the file keeps no per-item outcomes for these rows: no paired test "
    "is possible",
    "drop_not_shown": "3 experts are not significantly below 2 (Holm over seeds × benchmarks): "
    "nothing to explain at this n",
    "lengthening_restores": "the drop is shown and some lengthening run restores accuracy: early "
    "stopping can cause it",
    "lengthening_does_not_restore": "the drop is shown, and a run whose outputs are longer still "
    "scores significantly below 2 experts, none restores: early stopping alone does not cause it",
    "undecided": "the drop is shown, but no lengthening run is decisive either way at this n",
}

CORRECTIONS = {
    "drop": "Holm over every seed × benchmark (3 vs 2 experts, plain EOS rule)",
    "gain_over_plain": "Holm over every seed × benchmark × lengthening run (run vs plain 3 experts)",
    "below_two_experts": "Holm over every seed × benchmark × lengthening run (run vs plain "
    "2 experts)",
}


def _rows(run: dict[str, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    return {(r["n_experts"], r["eos_policy"]): r for r in run["termination"]["rows"]}


def _test(a: dict[str, float], b: dict[str, float]) -> dict[str, Any]:
    """Exact McNemar of ``a`` against ``b`` on their shared items (``a_only``: right in a only)."""
    ids = [i for i in a if i in b]
    return {"n": len(ids), **mcnemar_exact([a[i] == 1.0 for i in ids], [b[i] == 1.0 for i in ids])}


def _lengthening_runs(run: dict[str, Any], bench: str) -> dict[str, dict[str, Any]]:
    """The 3-expert runs that change how outputs end: every other EOS policy, and the run with
    EOS ruled out until the shortest reference (label ``min_length``)."""
    out = {
        f"eos_policy {p}": row["benchmarks"][bench]
        for (k, p), row in _rows(run).items()
        if k == 3 and p != "plain" and bench in row["benchmarks"]
    }
    for row in run["termination"].get("min_length_rows", []):
        if row["n_experts"] == 3 and bench in row["benchmarks"]:
            out["min_length"] = row["benchmarks"][bench]
    return out


def _min_length(run: dict[str, Any], bench: str) -> int | None:
    for row in run["termination"].get("min_length_rows", []):
        if bench in row.get("min_new_tokens", {}):
            return row["min_new_tokens"][bench]
    return None


def lost_items(two: dict[str, Any], three: dict[str, Any], shortest: int | None) -> dict[str, Any]:
    """The items right with 2 experts and wrong with 3, by how the 3-expert output ended."""
    lost = [i for i, v in two["per_item"].items() if v == 1.0 and three["per_item"].get(i) == 0.0]
    out: dict[str, Any] = {"n": len(lost), "items": lost}
    s2, s3 = two.get("per_item_stop"), three.get("per_item_stop")
    if s2 is None or s3 is None:
        out["by_end"] = None  # stop positions not recorded
        return out
    by_end = dict.fromkeys(LOST_CATEGORIES, 0)
    before_shortest = 0
    for i in lost:
        (n3, why3), (n2, _) = s3[i], s2[i]
        if why3 == "length":
            by_end["token_limit"] += 1
        elif n3 < n2:
            by_end["stopped_early"] += 1
            before_shortest += shortest is not None and n3 < shortest
        else:
            by_end["full_length_wrong"] += 1
    out["by_end"] = by_end
    out["stopped_before_shortest_reference"] = before_shortest if shortest is not None else None
    out["shortest_reference_tokens"] = shortest
    out["mean_tokens_2_experts"] = _mean([s2[i][0] for i in lost])
    out["mean_tokens_3_experts"] = _mean([s3[i][0] for i in lost])
    return out


def best_case_drop(two: dict[str, Any], three: dict[str, Any]) -> dict[str, Any]:
    """From the two scores alone: the fewest items the 3-expert run can have lost net, and the
    smallest exact McNemar p any pairing of the outcomes allows (all discordant items lost, none
    gained: p = 2 · 0.5^d). Above α, no per-item record could show the drop."""
    d = round((two["mean"] - three["mean"]) * two["n"])
    p = 1.0 if d <= 0 else min(1.0, 2 * 0.5**d)
    return {"net_lost_items": d, "smallest_possible_p": p}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _tokens(rec: dict[str, Any]) -> float:
    return rec["cost"]["mean_new_tokens"]


def analyse(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``runs``: label (the file) → results.json content. Returns the analysis (module doc)."""
    per: dict[str, Any] = {}
    drops, gains, below = {}, {}, {}
    for label, run in runs.items():
        rows = _rows(run)
        two_row, three_row = rows[(2, "plain")]["benchmarks"], rows[(3, "plain")]["benchmarks"]
        benches: dict[str, Any] = {}
        for b in two_row:
            two, three = two_row[b], three_row[b]
            lengthening = _lengthening_runs(run, b)
            entry: dict[str, Any] = {
                "n": two["score"].get("n"),
                "score_2_experts": two["score"]["mean"],
                "score_3_experts": three["score"]["mean"],
                "tokens_2_experts": _tokens(two),
                "tokens_3_experts": _tokens(three),
                "lengthening": {
                    name: {"score": rec["score"]["mean"], "tokens": _tokens(rec)}
                    for name, rec in lengthening.items()
                },
            }
            recorded = "per_item" in two and "per_item" in three
            entry["per_item_recorded"] = recorded
            if not recorded:
                entry["drop_best_case"] = best_case_drop(two["score"], three["score"])
            else:
                entry["drop"] = drops[(label, b)] = _test(three["per_item"], two["per_item"])
                lost = lost_items(two, three, _min_length(run, b))
                entry["lost"] = lost
                for name, rec in lengthening.items():
                    if "per_item" not in rec:
                        continue
                    e = entry["lengthening"][name]
                    e["gain_over_plain"] = gains[(label, b, name)] = _test(
                        rec["per_item"], three["per_item"]
                    )
                    e["vs_2_experts"] = below[(label, b, name)] = _test(
                        rec["per_item"], two["per_item"]
                    )
                    e["recovered_lost_items"] = sum(
                        rec["per_item"].get(i) == 1.0 for i in lost["items"]
                    )
                    if rec.get("per_item_stop") and lost["items"]:
                        e["mean_tokens_on_lost_items"] = _mean(
                            [rec["per_item_stop"][i][0] for i in lost["items"]]
                        )
            benches[b] = entry
        cfg = run["config"]
        per[label] = {"seed": cfg["seed"], "scale": cfg["scale"], "benchmarks": benches}
    _holm_into(drops, per, lambda e, k: e["drop"])
    _holm_into(gains, per, lambda e, k: e["lengthening"][k[2]]["gain_over_plain"])
    _holm_into(below, per, lambda e, k: e["lengthening"][k[2]]["vs_2_experts"])
    for p in per.values():
        for entry in p["benchmarks"].values():
            _categorise(entry)
    verdicts = Counter(e["verdict"] for p in per.values() for e in p["benchmarks"].values())
    by_bench: dict[str, Counter] = {}
    for p in per.values():
        for b, e in p["benchmarks"].items():
            by_bench.setdefault(b, Counter())[e["verdict"]] += 1
    lost_total = Counter()
    for p in per.values():
        for e in p["benchmarks"].values():
            if e.get("lost", {}).get("by_end"):
                lost_total.update(e["lost"]["by_end"])
    return {
        "inputs": [{"file": k, "seed": p["seed"], "scale": p["scale"]} for k, p in per.items()],
        "alpha": ALPHA,
        "corrections": CORRECTIONS,
        "categories": {"lost": LOST_CATEGORIES, "run": RUN_CATEGORIES, "verdict": VERDICTS},
        "runs": per,
        "summary": {
            "verdicts": {v: verdicts.get(v, 0) for v in VERDICTS},
            "verdicts_by_benchmark": {
                b: {v: c[v] for v in VERDICTS if c[v]} for b, c in by_bench.items()
            },
            "lost_items_by_end": dict(lost_total) if lost_total else None,
        },
    }


def _holm_into(family: dict[tuple, dict[str, Any]], per: dict[str, Any], where) -> None:
    for key, p in holm({k: t["p_value"] for k, t in family.items()}).items():
        where(per[key[0]]["benchmarks"][key[1]], key)["p_holm"] = p


def _significant(test: dict[str, Any] | None, first_wins: bool) -> bool:
    """Holm-significant in the stated direction (``first_wins``: the first candidate better)."""
    if test is None or test["p_holm"] > ALPHA:
        return False
    return test["a_only"] > test["b_only"] if first_wins else test["b_only"] > test["a_only"]


def _categorise(entry: dict[str, Any]) -> None:
    """The run categories and the verdict of one seed × benchmark (:data:`VERDICTS`)."""
    for run in entry["lengthening"].values():
        if run["tokens"] <= entry["tokens_3_experts"]:
            run["category"] = "does_not_lengthen"
        elif "gain_over_plain" not in run:
            run["category"] = (
                "lengthens_without_score_gain"
                if run["score"] <= entry["score_3_experts"]
                else "lengthens_gain_untested"
            )
        elif _significant(run["gain_over_plain"], True) and not _significant(
            run["vs_2_experts"], False
        ):
            run["category"] = "lengthens_and_restores"
        elif _significant(run["vs_2_experts"], False):
            run["category"] = "lengthens_without_restoring"
        else:
            run["category"] = "lengthens_undecided"
    cats = {run["category"] for run in entry["lengthening"].values()}
    if not entry["per_item_recorded"]:
        entry["verdict"] = "per_item_not_recorded"
    elif not _significant(entry["drop"], False):
        entry["verdict"] = "drop_not_shown"
    elif "lengthens_and_restores" in cats:
        entry["verdict"] = "lengthening_restores"
    elif "lengthens_without_restoring" in cats:
        entry["verdict"] = "lengthening_does_not_restore"
    else:
        entry["verdict"] = "undecided"


def _has_plain_rows(run: Any) -> bool:
    try:
        rows = _rows(run)
    except (KeyError, TypeError):
        return False
    return all(k in rows and "benchmarks" in rows[k] for k in ((2, "plain"), (3, "plain")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="results.json files (or their folders)")
    p.add_argument("--out", type=Path, required=True, help="the analysis, as JSON")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    args = p.parse_args(argv)
    runs = {}
    for path in args.results:
        f = path / "results.json" if path.is_dir() else path
        try:
            run = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"error: {f}: {exc}", file=sys.stderr)
            return 2
        if not _has_plain_rows(run):
            print(
                f"error: {f}: no 2- and 3-expert plain rows under termination.rows", file=sys.stderr
            )
            return 2
        runs[str(f)] = run
    analysis = analyse(runs)
    try:
        write_json_atomic(
            args.out,
            analysis,
            indent=1,
            force=args.force,
            written_by_mergelab=json_with_keys("inputs", "runs", "summary"),
        )
    except ForeignOutputError as exc:
        print(f"error: {args.out}: {exc}", file=sys.stderr)
        return 2
    except OutputExistsError:
        print(f"error: {args.out} exists; pass --force to replace it", file=sys.stderr)
        return 2
    print(json.dumps(analysis["summary"], indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
