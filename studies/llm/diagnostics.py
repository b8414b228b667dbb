"""Factorisation diagnostics per benchmark (``mergelab.compose.diagnostics``), teacher-forced on
the reference solutions, and whether they predict where composition wins or loses: per item,
the share of positions where both experts are active vs composition − best expert."""

from __future__ import annotations

from typing import Any

from mergelab.compose import ComposedDecoder
from mergelab.eval import Benchmark, build_prompt

from .setting import Setting


def diagnostics_study(
    setting: Setting, benches: dict[str, Benchmark], comparison: dict[str, Any]
) -> dict[str, Any]:
    """Diagnostics on each of ``benches`` (test splits); ``comparison`` holds the main table's
    per-item outcomes and choices (:func:`studies.llm.candidates.study_tables`)."""
    from mergelab.compose.diagnostics import composition_diagnostics

    tok = setting.tokenizer
    decoder = ComposedDecoder(
        setting.base,
        [setting.experts["math"], setting.experts["code"]],
        tok,
        expert_names=["math", "code"],
        name="composition",
    )
    out: dict[str, Any] = {}
    for bname, bench in benches.items():
        refs = setting.reference.get(bname)
        items = [
            it for it in bench.items if (refs and it.item_id in refs) or (not refs and it.solution)
        ]
        if not items:
            continue
        prompts = [
            build_prompt(it, bench, setting.eval_settings[bname].prompt, tok) for it in items
        ]
        conts = [refs[it.item_id] if refs else it.solution for it in items]
        report = composition_diagnostics(
            decoder, prompts, conts, thresholds=(0.01, 0.1, 1.0), keep_positions=True
        )
        d = report.to_dict()
        per_position = d.pop("per_position_kl")
        d["per_item_coactive_0.1"] = {
            it.item_id: (sum(min(kl) > 0.1 for kl in seq) / len(seq) if seq else 0.0)
            for it, seq in zip(items, per_position)
        }
        d["vs_outcome"] = coactivity_vs_outcome(comparison, bname, d["per_item_coactive_0.1"])
        out[bname] = d
    return out


def coactivity_vs_outcome(
    comparison: dict[str, Any], bench: str, coactive: dict[str, float]
) -> dict[str, Any]:
    """Mean per-item co-activity where composition beats / ties / loses to the best expert."""
    table = comparison["candidates"]
    best = comparison["choices"]["best_expert"].get(bench, {}).get("chosen")
    if best is None or bench not in table.get("composition", {}):
        return {}
    comp, ref = table["composition"][bench]["per_item"], table[best][bench]["per_item"]
    groups: dict[str, list[float]] = {"wins": [], "ties": [], "loses": []}
    for item_id, c in coactive.items():
        if item_id in comp and item_id in ref:
            d = comp[item_id] - ref[item_id]
            groups["wins" if d > 0 else "loses" if d < 0 else "ties"].append(c)
    summary = {
        k: {"n": len(v), "mean_coactive_0.1": sum(v) / len(v) if v else None}
        for k, v in groups.items()
    }
    return {"best_expert": best, **summary}
