"""Trivial baselines, reported as the floor beside every candidate.

Each synthetic task declares its own (``mergelab.eval.synthetic_tasks``): "sum_of_numbers" adds
the numbers written in the problem (``#### <sum>`` for math, a body returning the sum for the
function-from-a-story sets). On the synthetic math and mixed sets, whose stories mostly add, it
solves a large share of items without reading a verb; a candidate that does not beat it has not
shown the skill. The baseline's completions are scored by the task exactly as a model's are.
"""

from __future__ import annotations

from typing import Any

from mergelab.eval import Benchmark, EvalSettings
from mergelab.eval.tasks import baseline_completions, get_task, score_completions


def baselines(
    benches: dict[str, Benchmark], settings: dict[str, EvalSettings], sandbox
) -> dict[str, Any]:
    """Baseline → benchmark → score and per-item 0/1 outcomes, for every baseline the
    benchmarks' tasks declare."""
    out: dict[str, dict[str, Any]] = {}
    for name, bench in benches.items():
        for baseline in get_task(bench.task).baselines:
            completions = baseline_completions(bench, baseline)
            ok = score_completions(bench, completions, settings[name], sandbox=sandbox)
            per_item = {i: float(v) for i, v in ok.items()}
            out.setdefault(baseline, {})[name] = {
                "score": sum(per_item.values()) / len(per_item),
                "per_item": per_item,
            }
    return out


def majority_answer_floor(
    validation: Benchmark, test: Benchmark, settings: EvalSettings, sandbox=None
) -> dict[str, Any]:
    """``#### <the most common answer of the validation items>`` for every test item (ties: the
    smallest number): the floor of a set scored on its final answer whose task declares no
    baseline of its own (the counting set, whose answers are word counts of a few values)."""
    answers = [it.answer for it in validation.items if it.answer is not None]
    if not answers:
        raise ValueError(f"{validation.name!r} has no answers to take the majority of")
    counts = {a: answers.count(a) for a in answers}
    top = max(counts.values())
    mode = min((a for a, c in counts.items() if c == top), key=lambda a: (len(a), a))
    completions = {it.item_id: f" #### {mode}" for it in test.items}
    ok = score_completions(test, completions, settings, sandbox=sandbox)
    per_item = {i: float(v) for i, v in ok.items()}
    return {"answer": mode, "score": sum(per_item.values()) / len(per_item), "per_item": per_item}


# The sets floors are computed on: (label, scale, size overrides). "smollm2" keeps the 40 test
# items per set of the smollm2 runs committed first; "smollm2_n150" is the scale's default now.
FLOOR_SETS = (
    ("mini", "mini", {}),
    ("smollm2", "smollm2", {"n_test": 40, "n_fresh": 40}),
    ("smollm2_n150", "smollm2", {}),
)


def floors_without_models(sets=FLOOR_SETS, seeds=(0, 1, 2)) -> dict[str, Any]:
    """The baselines on each set's synthetic test sets (no model is trained or loaded: the sets
    depend only on the scale's sizes and the seed), and how many test targets are, as strings,
    some training target."""
    from mergelab.eval.sandbox import Sandbox

    from .config import scale_config
    from .setting import synthetic_data

    out: dict[str, Any] = {}
    with Sandbox(workers=2) as sandbox:
        for label, scale, sizes in sets:
            for seed in seeds:
                _, held = synthetic_data(scale_config(scale, seed=seed, **sizes))
                benches = {**held.test, **held.fresh}
                floors = baselines(benches, held.eval_settings, sandbox)
                # the counting set declares no baseline: the validation set's majority answer
                count = majority_answer_floor(
                    held.third_validation["count"],
                    held.third_test["count"],
                    held.eval_settings["count"],
                )
                floors["majority_answer"] = {"count": count}
                benches["count"] = held.third_test["count"]
                seen = {
                    b: sum(t in held.train_targets for t in refs.values()) / len(refs)
                    for b, refs in held.reference.items()
                }
                out[f"{label}/seed{seed}"] = {
                    "n_test": {b: len(bench.items) for b, bench in benches.items()},
                    "baselines": {
                        k: {b: v["score"] for b, v in per.items()} for k, per in floors.items()
                    },
                    "test_targets_seen_in_training": seen,
                }
    return out


def committed_vs_floor(results: dict[str, Any], floors: dict[str, float], bench: str) -> dict:
    """Exact McNemar of each candidate of a results file against the floor's per-item outcomes
    on ``bench`` (the same item ids: the sets are regenerated from the same seed)."""
    from mergelab.eval.stats import mcnemar_exact

    out = {}
    for cand, recs in results["candidates"].items():
        per = recs.get(bench, {}).get("per_item")
        if not per or set(per) != set(floors):
            continue
        ids = sorted(per)
        test = mcnemar_exact([per[i] == 1.0 for i in ids], [floors[i] == 1.0 for i in ids])
        out[cand] = {
            "score": sum(per.values()) / len(ids),
            "floor": sum(floors.values()) / len(ids),
            **test,
        }
    return out


def main(out_path: str) -> None:
    """``results/llm/floors.json``: the floors of every scale and seed, and the committed mixed-set
    results against them."""
    import json
    from pathlib import Path

    from mergelab.eval.sandbox import Sandbox
    from mergelab.results import json_with_keys, write_json_atomic

    from .config import scale_config
    from .setting import synthetic_data

    summary = {"floors": floors_without_models(), "committed_vs_floor": {}}
    root = Path(__file__).resolve().parents[2] / "results" / "llm"
    with Sandbox(workers=2) as sandbox:
        for folder in ("mini", "mini_replay", "smollm2", "smollm2_seed1"):
            res = json.loads((root / folder / "results.json").read_text())
            # the sets as that run drew them (its sizes, not the scale's current defaults)
            sizes = {k: res["config"][k] for k in ("n_train", "n_validation", "n_test")}
            cfg = scale_config(res["config"]["scale"], seed=res["config"]["seed"], **sizes)
            _, held = synthetic_data(cfg)
            per = baselines({"mixed": held.test["mixed"]}, held.eval_settings, sandbox)
            floor = per["sum_of_numbers"]["mixed"]["per_item"]
            summary["committed_vs_floor"][f"results/llm/{folder}"] = {
                "mixed": committed_vs_floor(res, floor, "mixed")
            }
    recognised = json_with_keys("floors")
    write_json_atomic(
        Path(out_path), summary, indent=1, ensure_ascii=True, written_by_mergelab=recognised
    )


if __name__ == "__main__":  # python -m studies.llm.baselines results/llm/floors.json
    import sys

    main(sys.argv[1])
