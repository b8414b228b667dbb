"""More than two experts: does the composition stop too early, and what helps?

* :func:`premature_termination` — per benchmark, how generations end compared with the reference
  solution: generated vs reference length, outputs that stop early, outputs that are a strict
  prefix of the reference, outputs that end right after the ``####`` marker, and p(EOS)
  teacher-forced at *every* position of the reference (where it should be ~0) and at its end
  (where it should be ~1). The stop rate alone only detects failing to stop.
* :func:`termination_study` — 2 vs 3 experts under each EOS policy, measured as above.
* :func:`remedies_study` — for 3 experts, remedies chosen on validation (an EOS policy; expert
  weights w < 1 that bound the base's exponent 1 − k·w, e.g. w = 1/(k−1) = 0.5 gives −0.5
  instead of −2; and both together), then reported on test with the exact McNemar test against
  the plain 3-expert composition.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from mergelab import ModelCandidate
from mergelab.compose import ComposedDecoder
from mergelab.eval import Benchmark, EvalSettings, build_prompt, evaluate, read_generations
from mergelab.eval.stats import holm, paired_comparison

from .setting import Setting

N_BINS = 5  # p(EOS) inside the reference, by fifths of its length


class Evaluator:
    """Evaluates a candidate on a benchmark (generations cached on disk) into a record with the
    texts and token counts of every item, which the termination measures need."""

    def __init__(self, cache_dir: Path, sandbox, progress: bool | None = None):
        self.cache_dir, self.sandbox = cache_dir, sandbox
        self.progress = sys.stderr.isatty() if progress is None else progress

    def record(self, candidate, bench: Benchmark, settings: EvalSettings) -> dict[str, Any]:
        result = evaluate(
            candidate,
            bench,
            settings,
            cache_dir=self.cache_dir,
            sandbox=self.sandbox,
            progress=self.progress,
        )
        return make_record(result, candidate)


def make_record(result, candidate) -> dict[str, Any]:
    """Score with CI, per-item scores, texts and token counts, cost and termination of one
    evaluation (cost as in docs/compare.md, with wall time in seconds per token)."""
    metric = result.primary_metric
    wanted = {it["item_id"] for it in result.items}
    records = read_generations(result.run_dir / "generations.jsonl")
    gens = [g for (item_id, _), g in records.items() if item_id in wanted]
    tokens = sum(g["n_tokens"] for g in gens)
    n = max(1, len(gens))
    return {
        "metric": metric,
        "score": result.summary["metrics"][metric],
        "per_item": {it["item_id"]: it["scores"][metric] for it in result.items},
        "per_item_tokens": {g["item_id"]: g["n_tokens"] for g in gens},
        "per_item_finish": {g["item_id"]: g["finish_reason"] for g in gens},
        "per_item_text": {it["item_id"]: it["samples"][0]["text"] for it in result.items},
        "cost": {
            "model_evaluations_per_token": len(
                getattr(getattr(candidate, "composition", None), "components", ("model",))
            ),
            "forward_calls_per_token": sum(g["forward_passes"] for g in gens) / max(1, tokens),
            "seconds_per_token": sum(g["seconds"] for g in gens) / max(1, tokens),
            "mean_new_tokens": tokens / n,
        },
        "termination": {
            "stop_rate": sum(g["finish_reason"] != "length" for g in gens) / n,
            "eos_rate": sum(g["finish_reason"] == "eos" for g in gens) / n,
        },
        "examples": [s["samples"][0]["text"] for s in result.items[:3]],
        "cache_dir": str(result.run_dir),
    }


def argmax(scores: dict[float, float], prefer: float) -> float:
    """Best validation score; ties go to the value closest to ``prefer`` (then the first)."""
    best = max(scores.values())
    return min((k for k, v in scores.items() if v == best), key=lambda k: abs(k - prefer))


@torch.no_grad()
def eos_profile(candidate, bench: Benchmark, setting: Setting, bname: str) -> dict[str, Any]:
    """Teacher-force prompt + reference: p(EOS) at every reference position (should be ~0) and
    where the reference ends (should be ~1); the share of items where EOS is the most likely
    token somewhere inside the reference (greedy decoding would stop there). p(EOS) sums over
    the candidate's EOS ids (the ids that end its generations); the first 64 items."""
    eos, refs = torch.tensor(candidate.eos_token_ids), setting.reference.get(bname)
    if not refs or not len(eos):
        return {}
    at_end, inside, argmax_inside, bins = [], [], [], [[] for _ in range(N_BINS)]
    prompt_cfg = setting.eval_settings[bname].prompt
    for it in bench.items[:64]:
        if it.item_id not in refs:
            continue
        p = candidate.encode_prompt(build_prompt(it, bench, prompt_cfg, setting.tokenizer))
        c = candidate.encode_continuation(refs[it.item_id])
        ids = torch.tensor([p + c])
        lp = candidate.token_logprobs(ids, torch.ones_like(ids))[0, len(p) - 1 :]  # [len(c)+1, V]
        probs = lp[:, eos].exp().sum(-1)  # every id that ends a row (the candidate's EOS set)
        at_end.append(float(probs[-1]))
        inner = probs[:-1]
        inside.append(float(inner.mean()))
        argmax_inside.append(bool(torch.isin(lp[:-1].argmax(-1), eos).any()))
        for j, v in enumerate(inner.tolist()):
            bins[min(N_BINS - 1, j * N_BINS // len(inner))].append(v)
    if not at_end:
        return {}
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {
        "at_reference_end": mean(at_end),
        "inside_reference": mean(inside),
        "inside_by_fifth": [mean(b) for b in bins],
        "eos_argmax_inside_share": mean([float(a) for a in argmax_inside]),
    }


def premature_termination(record: dict[str, Any], setting: Setting, bname: str) -> dict[str, Any]:
    """How generations end, against the reference solution. Token counts exclude EOS on both
    sides (the harness's ``n_tokens`` does not count the EOS that ended a row), so an output equal
    to the reference has length ratio 1."""
    refs = setting.reference.get(bname)
    if not refs:
        return {}
    tok = setting.tokenizer
    ids = [i for i in record["per_item_tokens"] if i in refs]
    ref_len = {i: len(tok(refs[i], add_special_tokens=False)["input_ids"]) for i in ids}
    gen_len = {i: record["per_item_tokens"][i] for i in ids}
    texts = {i: record["per_item_text"].get(i, "") for i in ids}
    n = max(1, len(ids))
    return {
        "n_items": len(ids),
        "mean_generated_tokens": sum(gen_len.values()) / n,
        "mean_reference_tokens": sum(ref_len.values()) / n,
        "mean_length_ratio": sum(gen_len[i] / ref_len[i] for i in ids) / n,
        "shorter_than_reference": sum(gen_len[i] < ref_len[i] for i in ids) / n,
        "strict_prefix_of_reference": sum(
            len(texts[i].strip()) > 0 and refs[i].startswith(texts[i]) and texts[i] != refs[i]
            for i in ids
        )
        / n,
        "ends_right_after_marker": sum(texts[i].rstrip().endswith("####") for i in ids) / n,
    }


def _measured(record, candidate, bench, setting, bname, eos_prob: bool = True) -> dict[str, Any]:
    """The record's score, cost, termination and per-item outcomes, and where every item stopped
    (``per_item_stop``: [generated tokens, finish reason] — "eos", "stop" for a stop string, or
    "length" at the token limit), measured against the reference."""
    keep = ("score", "cost", "termination", "examples", "per_item")
    stops = {i: [n, record["per_item_finish"][i]] for i, n in record["per_item_tokens"].items()}
    return {
        **{k: record[k] for k in keep},
        "per_item_stop": stops,
        "premature": premature_termination(record, setting, bname),
        "eos_prob": eos_profile(candidate, bench, setting, bname) if eos_prob else {},
    }


def shortest_reference_tokens(setting: Setting, bench: Benchmark, bname: str) -> int | None:
    """The fewest tokens of any reference solution of ``bench``'s items (None: no references)."""
    refs = setting.reference.get(bname) or {}
    lengths = [
        len(setting.tokenizer(refs[it.item_id], add_special_tokens=False)["input_ids"])
        for it in bench.items
        if it.item_id in refs
    ]
    return min(lengths) if lengths else None


def _decoder(setting: Setting, names: list[str], policy: str, weight: float, name: str):
    experts = [setting.experts[n] for n in names]
    return ComposedDecoder(
        setting.base,
        experts,
        setting.tokenizer,
        [weight] * len(names),
        expert_names=names,
        eos_policy=policy,
        name=name,
    )


def termination_study(
    setting: Setting,
    benches: dict[str, Benchmark],
    ev: Evaluator,
    policies: tuple[str, ...],
    third: str,
    min_length_test: bool = False,
) -> dict[str, Any]:
    """Compose 2 vs 3 experts (w = 1) under each EOS policy on ``benches`` (test splits); with
    ``min_length_test``, both again with EOS ruled out until each benchmark's shortest reference
    length (does a longer output restore accuracy?); each expert alone as the reference level."""
    rows = []
    for k, names in ((2, ["math", "code"]), (3, ["math", "code", third])):
        for policy in policies:
            cand = _decoder(setting, names, policy, 1.0, f"compose{k}_{policy}")
            recs = {}
            for b, bench in benches.items():
                rec = ev.record(cand, bench, setting.eval_settings[b])
                recs[b] = _measured(rec, cand, bench, setting, b)
            rows.append(
                {"n_experts": k, "experts": names, "eos_policy": policy, "benchmarks": recs}
            )
            print(
                f"  compose{k}_{policy:15s} "
                + "  ".join(
                    f"{b}: score={r['score']['mean']:.2f} len={r['premature']['mean_length_ratio']:.2f}"
                    for b, r in recs.items()
                ),
                flush=True,
            )
    # Does lengthening restore accuracy? EOS ruled out until the shortest reference's length
    # (at most the token limit).
    min_length_rows = []
    if min_length_test:
        for k, names in ((2, ["math", "code"]), (3, ["math", "code", third])):
            cand = _decoder(setting, names, "plain", 1.0, f"compose{k}_plain")
            recs, floors = {}, {}
            for b, bench in benches.items():
                shortest = shortest_reference_tokens(setting, bench, b)
                if shortest is None:
                    continue
                settings = setting.eval_settings[b]
                floors[b] = min(shortest, settings.generation.max_new_tokens)
                gen = dataclasses.replace(settings.generation, min_new_tokens=floors[b])
                rec = ev.record(cand, bench, dataclasses.replace(settings, generation=gen))
                recs[b] = _measured(rec, cand, bench, setting, b, eos_prob=False)
            min_length_rows.append(
                {
                    "n_experts": k,
                    "experts": names,
                    "eos_policy": "plain",
                    "min_new_tokens": floors,
                    "benchmarks": recs,
                }
            )
            print(
                f"  compose{k}_min_length    "
                + "  ".join(
                    f"{b}: score={r['score']['mean']:.2f} len={r['premature']['mean_length_ratio']:.2f}"
                    for b, r in recs.items()
                ),
                flush=True,
            )
    # Each expert alone on every set: the reference levels (the counting expert's own score on
    # the counting set is what a composition with it is measured against).
    singles, single_scores = {}, {}
    for name in ["math", "code", third]:
        cand = ModelCandidate(setting.experts[name], setting.tokenizer, name=f"{name}_expert")
        singles[name] = {b: eos_profile(cand, bench, setting, b) for b, bench in benches.items()}
        single_scores[name] = {
            b: _measured(
                ev.record(cand, bench, setting.eval_settings[b]),
                cand,
                bench,
                setting,
                b,
                eos_prob=False,
            )
            for b, bench in benches.items()
        }
    return {
        "third_expert": third,
        "rows": rows,
        "min_length_rows": min_length_rows,
        "single_experts": single_scores,
        "single_expert_eos_prob": singles,
    }


def remedies_study(
    setting: Setting,
    validation: dict[str, Benchmark],
    test: dict[str, Benchmark],
    ev: Evaluator,
    policies: tuple[str, ...],
    weights: tuple[float, ...],
    third: str,
    bootstrap_samples: int,
    seed: int,
) -> dict[str, Any]:
    """3 experts: weight × EOS policy scored on validation (mean over ``validation``); three
    remedies chosen there — the best policy at w = 1, the best weight with the plain policy, the
    best pair — and each reported on test against the plain composition (w = 1, "plain"). Ties
    go to w = 1, then to the earlier policy ("plain" first)."""
    names = ["math", "code", third]

    def cand(w: float, policy: str):  # at w = 1 the same candidate (and cache) as the 2-vs-3 rows
        name = f"compose3_{policy}" if w == 1.0 else f"compose3_w{w}_{policy}"
        return _decoder(setting, names, policy, w, name)

    def val_score(w: float, policy: str) -> float:
        c = cand(w, policy)
        recs = [ev.record(c, b, setting.eval_settings[n]) for n, b in validation.items()]
        return sum(r["score"]["mean"] for r in recs) / len(recs)

    grid = {(w, p): val_score(w, p) for w in weights for p in policies}
    default = (1.0, "plain")
    chosen = {
        "eos_policy": (1.0, max(policies, key=lambda p: (grid[(1.0, p)], -policies.index(p)))),
        "weight": (argmax({w: grid[(w, "plain")] for w in weights}, prefer=1.0), "plain"),
        "weight_and_eos_policy": max(
            grid, key=lambda k: (grid[k], -abs(k[0] - 1.0), -policies.index(k[1]))
        ),
    }
    rows = {}
    for label, (w, policy) in {"plain": default, **chosen}.items():
        c = cand(w, policy)
        recs = {}
        for b, bench in test.items():
            rec = ev.record(c, bench, setting.eval_settings[b])
            recs[b] = _measured(rec, c, bench, setting, b)
        rows[label] = {
            "weight": w,
            "eos_policy": policy,
            "base_exponent": 1 - len(names) * w,
            "validation": grid[(w, policy)],
            "benchmarks": recs,
        }
    for label, row in rows.items():
        if label != "plain":
            row["vs_plain"] = {
                b: paired_comparison(
                    r["per_item"],
                    rows["plain"]["benchmarks"][b]["per_item"],
                    n_boot=bootstrap_samples,
                    seed=seed,
                )
                for b, r in row["benchmarks"].items()
            }
    # One family: every remedy against the plain composition on every benchmark (Holm).
    family = {
        (label, b): cmp["p_value"]
        for label, row in rows.items()
        for b, cmp in row.get("vs_plain", {}).items()
    }
    for (label, b), p_adj in holm(family).items():
        rows[label]["vs_plain"][b]["p_holm"] = p_adj
    return {
        "experts": names,
        "correction": "p_holm: Holm over every remedy × benchmark test",
        "validation_grid": [
            {"weight": w, "eos_policy": p, "validation": v} for (w, p), v in grid.items()
        ],
        "rows": rows,
    }
