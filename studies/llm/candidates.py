"""The comparison at the heart of the study: every candidate on every benchmark, choices made on
validation, paired statistics against the best single expert.

:func:`compare_candidates` is one function with a plain input (the models, the benchmarks with
their splits, the grids) and output (per-item outcomes per candidate and benchmark, the choices
with every validation score, the paired statistics); a general ``compare`` engine can replace it
without touching the rest of the study.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mergelab import ModelCandidate
from mergelab.compose import ComposedDecoder
from mergelab.eval import Benchmark, EvalSettings, compare, evaluate
from mergelab.merge import merge_models
from mergelab.merge.checkpoint import MERGE_RECORD_NAME


@dataclass
class Models:
    """What is combined: a base and the math and code experts (in memory; at the paper scale
    also as checkpoint folders, so weight merges stream from disk), optional LoRA adapters."""

    tokenizer: Any
    base: torch.nn.Module
    experts: dict[str, torch.nn.Module]  # "math", "code"
    lora_adapters: dict[str, Path] = field(default_factory=dict)
    evaluate_lora_experts: bool = False  # also each LoRA expert alone (when they are extra rows)
    base_dir: Path | None = None
    expert_dirs: dict[str, Path] = field(default_factory=dict)
    merge_dir: Path | None = None
    dtype: str = "float32"
    device: torch.device = torch.device("cpu")
    keep_merges: bool = False


@dataclass
class Splits:
    """One benchmark: its test split, its validation split (``None``: test only — choices use
    the validation split named by ``validation_of``), and how it is evaluated."""

    test: Benchmark
    validation: Benchmark | None
    settings: EvalSettings
    validation_of: str | None = None  # another benchmark whose validation split stands in


@dataclass
class Grids:
    """Grid of each candidate family; the grid point that goes to test is chosen on validation
    (ties: the point closest to the paper's default)."""

    composition_weights: tuple[float, ...]
    task_arithmetic_lambdas: tuple[float, ...]
    ties_lambdas: tuple[float, ...]
    ties_densities: tuple[float, ...]
    dare_lambdas: tuple[float, ...]
    dare_density: float
    bootstrap_samples: int = 2000
    seed: int = 0


class Evaluator:
    """Evaluates a candidate on benchmarks (generations cached on disk) into records."""

    def __init__(self, benchmarks: dict[str, Splits], cache_dir: Path, sandbox):
        self.benchmarks, self.cache_dir, self.sandbox = benchmarks, cache_dir, sandbox

    def record(self, candidate, bench: Benchmark, settings: EvalSettings) -> dict[str, Any]:
        result = evaluate(candidate, bench, settings, cache_dir=self.cache_dir,
                          sandbox=self.sandbox, progress=sys.stderr.isatty())  # fmt: skip
        return make_record(result, candidate)

    def test(self, candidate) -> dict[str, dict[str, Any]]:
        recs = {n: self.record(candidate, s.test, s.settings) for n, s in self.benchmarks.items()}
        print(f"  {candidate.name:28s} " + "  ".join(
            f"{b}={r['score']['mean']:.3f}" for b, r in recs.items()), flush=True)  # fmt: skip
        return recs

    def validation(self, candidate) -> dict[str, dict[str, Any]]:
        return {n: self.record(candidate, s.validation, s.settings)
                for n, s in self.benchmarks.items() if s.validation is not None}  # fmt: skip

    def validation_score(self, candidate) -> float:
        recs = self.validation(candidate)
        return sum(r["score"]["mean"] for r in recs.values()) / len(recs)


def make_record(result, candidate) -> dict[str, Any]:
    """Score with CI, per-item scores and texts, cost and termination of one evaluation.

    Cost: ``model_evaluations_per_token`` is the number of component models run per decoding
    step (1 for a model or a merge, k + 1 for a composition of k experts; the LoRA fast path runs
    them as one batched forward); ``forward_calls_per_token`` is the decoder's own count of
    forward calls per sequence and generated token (it depends on batching and on when the other
    rows of a batch stop, so compare it only at equal batch sizes); ``seconds_per_token`` is
    wall time (batch time split evenly over its rows) per generated token.
    """
    metric = result.primary_metric
    with open(result.run_dir / "generations.jsonl", encoding="utf-8") as f:
        gens = [json.loads(line) for line in f]
    wanted = {it["item_id"] for it in result.items}
    gens = [g for g in gens if g["item_id"] in wanted]
    tokens = sum(g["n_tokens"] for g in gens)
    n = max(1, len(gens))
    return {
        "metric": metric,
        "score": result.summary["metrics"][metric],
        "per_item": {it["item_id"]: it["scores"][metric] for it in result.items},
        "per_item_tokens": {g["item_id"]: g["n_tokens"] for g in gens},
        "per_item_text": {it["item_id"]: it["samples"][0]["text"] for it in result.items},
        "cost": {
            "model_evaluations_per_token": len(candidate.composition.components),
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


@contextlib.contextmanager
def merged(models: Models, method: str, name: str, seed: int, **kwargs):
    """A weight merge of the math and code experts as a candidate (``kwargs``: params, weights).

    Where the experts are checkpoint folders (the paper scale), the merge is streamed tensor by
    tensor by ``mergelab.merge.checkpoint`` into a folder and loaded back, so the merge itself
    never holds base and experts in memory; the folder is deleted on exit unless
    ``models.keep_merges`` (a rerun finds its generations in the evaluation cache anyway). Small
    in-memory experts are merged with ``merge_models``."""
    if not models.expert_dirs:
        experts = [models.experts["math"], models.experts["code"]]
        model = merge_models(method, models.base, experts, seed=seed, **kwargs)
        yield ModelCandidate(model, models.tokenizer, name=name)
        return
    from transformers import AutoModelForCausalLM

    from mergelab.merge.checkpoint import merge_checkpoints

    dirs = [models.expert_dirs["math"], models.expert_dirs["code"]]
    key = json.dumps([method, [str(models.base_dir), *map(str, dirs)], kwargs, seed],
                     sort_keys=True, default=str)  # fmt: skip
    folder = models.merge_dir / f"{method}_{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if not (folder / MERGE_RECORD_NAME).exists():  # the engine writes it last, atomically
        merge_checkpoints(method, models.base_dir, dirs, output=folder, seed=seed, force=True,
                          progress=sys.stderr.isatty(), **kwargs)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, models.dtype))
    model = model.to(models.device).eval()
    try:
        yield ModelCandidate(model, models.tokenizer, name=name)
    finally:
        del model
        if not models.keep_merges:
            shutil.rmtree(folder, ignore_errors=True)


def argmax(scores: dict[Any, float], prefer: float | tuple[float, ...]) -> Any:
    """Best validation score; ties go to the grid point closest to ``prefer`` (the paper's
    choice; for a tuple of parameters, the smallest summed distance)."""
    best = max(scores.values())
    target = prefer if isinstance(prefer, tuple) else (prefer,)

    def distance(key) -> float:
        key = key if isinstance(key, tuple) else (key,)
        return sum(abs(a - b) for a, b in zip(key, target))

    return min((k for k, v in scores.items() if v == best), key=distance)


def compare_candidates(
    models: Models, benchmarks: dict[str, Splits], grids: Grids, *, cache_dir: Path, sandbox
) -> dict[str, Any]:
    """Every candidate on every benchmark's test split; every choice on validation.

    Returns ``candidates`` (candidate → benchmark → record with ``per_item`` outcomes),
    ``descriptions``, ``choices`` (each family's grid point with every validation score, and per
    benchmark the best single expert) and ``paired_vs_best_expert`` (paired bootstrap CI of the
    difference and the exact McNemar test, per benchmark, every candidate vs that expert).
    """
    ev = Evaluator(benchmarks, cache_dir, sandbox)
    tok, base = models.tokenizer, models.base
    pair, names = [models.experts["math"], models.experts["code"]], ["math", "code"]
    table: dict[str, dict[str, Any]] = {}
    descriptions: dict[str, Any] = {}
    choices: dict[str, Any] = {}

    def on_test(candidate) -> None:
        recs = ev.test(candidate)  # texts stay in the cache folder, not in the table
        table[candidate.name] = {b: {k: v for k, v in r.items() if k != "per_item_text"}
                                 for b, r in recs.items()}  # fmt: skip
        d = candidate.describe()
        descriptions[candidate.name] = {k: d.get(k) for k in ("type", "composition", "eos_policy")}

    def merge_on_test(method: str, name: str, **kwargs) -> None:
        with merged(models, method, name, grids.seed, **kwargs) as candidate:
            on_test(candidate)

    def merge_on_validation(method: str, name: str, **kwargs) -> float:
        with merged(models, method, name, grids.seed, **kwargs) as candidate:
            return ev.validation_score(candidate)

    on_test(ModelCandidate(base, tok, name="base"))
    singles = {
        f"{s}_expert": ModelCandidate(models.experts[s], tok, name=f"{s}_expert") for s in names
    }
    for candidate in singles.values():
        on_test(candidate)
    choices["best_expert"] = choose_best_expert(singles, benchmarks, ev)
    on_test(ComposedDecoder(base, pair, tok, expert_names=names, name="composition"))

    def composed(w: float, name: str) -> ComposedDecoder:
        return ComposedDecoder(base, pair, tok, [w, w], expert_names=names, name=name)

    val = {
        w: ev.validation_score(composed(w, f"composition_w{w}")) for w in grids.composition_weights
    }
    w = argmax(val, prefer=1.0)
    choices["composition_weight"] = {"chosen": w, "validation": val}
    on_test(composed(w, "composition_weighted"))

    val = {lam: merge_on_validation("task_arithmetic", f"ta_l{lam}", params={"lambda_": lam})
           for lam in grids.task_arithmetic_lambdas}  # fmt: skip
    lam = argmax(val, prefer=1.0)
    choices["task_arithmetic_lambda"] = {"chosen": lam, "validation": val}
    merge_on_test("task_arithmetic", "task_arithmetic", params={"lambda_": lam})

    # TIES: λ and density on validation; DARE-TIES: λ on validation (its density is fixed: the
    # random drop makes a density grid mostly a seed lottery at this size).
    val = {(lam, d): merge_on_validation("ties", f"ties_l{lam}_d{d}", params={"lambda_": lam, "density": d})
           for lam in grids.ties_lambdas for d in grids.ties_densities}  # fmt: skip
    lam, d = argmax(val, prefer=(1.0, 0.2))
    choices["ties"] = {"chosen": {"lambda": lam, "density": d},
                       "validation": {f"lambda={k[0]},density={k[1]}": v for k, v in val.items()}}  # fmt: skip
    merge_on_test("ties", "ties", params={"lambda_": lam, "density": d})
    dare = {"density": grids.dare_density}
    val = {lam: merge_on_validation("dare_ties", f"dare_ties_l{lam}", params={"lambda_": lam, **dare})
           for lam in grids.dare_lambdas}  # fmt: skip
    lam = argmax(val, prefer=1.0)
    choices["dare_ties"] = {"chosen": {"lambda": lam, **dare}, "validation": val}
    merge_on_test("dare_ties", "dare_ties", params={"lambda_": lam, **dare})
    merge_on_test("linear", "linear", weights=[0.5, 0.5])
    choices["merge_params"] = {"linear": {"weights": [0.5, 0.5]}}
    if models.lora_adapters:
        for candidate in lora_candidates(models):
            on_test(candidate)
    paired = paired_vs_best_expert(table, choices["best_expert"], grids)
    return {"candidates": table, "descriptions": descriptions, "choices": choices,
            "paired_vs_best_expert": paired}  # fmt: skip


def lora_candidates(models: Models):
    """LoRA experts (when they are extra rows), their composition (batched fast path) and their
    adapter merge (ΔW space), one at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mergelab.merge.lora import merge_lora_adapters

    tok, base = models.tokenizer, models.base
    folders = [models.lora_adapters["math"], models.lora_adapters["code"]]
    if models.evaluate_lora_experts:
        for skill, folder in zip(("math", "code"), folders):
            expert = PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload()
            yield ModelCandidate(expert.eval(), tok, name=f"{skill}_lora")
    yield ComposedDecoder.from_lora(base, folders, tok, expert_names=["math", "code"],
                                    name="lora_composition")  # fmt: skip
    merged_dir = models.base_dir.parent / "lora_merge_task_arithmetic"
    if not (merged_dir / "config.json").exists():
        merge_lora_adapters("task_arithmetic", folders, output=merged_dir, base=models.base_dir,
                            output_kind="full", params={"lambda_": 1.0}, force=True, progress=False)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(merged_dir).to(models.device).eval()
    yield ModelCandidate(model, tok, name="lora_merge_task_arithmetic")


def choose_best_expert(
    singles: dict[str, Any], benchmarks: dict[str, Splits], ev: Evaluator
) -> dict[str, Any]:
    """Per benchmark, the single expert that scores best on its VALIDATION split (never on
    test): the reference of the paired comparisons. A benchmark without its own validation split
    uses the one named by ``validation_of`` (e.g. HumanEval → synthetic code). Ties go to the
    expert with the higher mean validation score over all benchmarks, then to the first one."""
    val = {name: ev.validation(candidate) for name, candidate in singles.items()}
    overall = {
        c: sum(r["score"]["mean"] for r in recs.values()) / len(recs) for c, recs in val.items()
    }
    order = list(singles)
    out = {}
    for bench, splits in benchmarks.items():
        vbench = splits.validation_of or bench
        if any(vbench not in recs for recs in val.values()):
            raise ValueError(
                f"benchmark {bench!r} has no validation split to choose the best expert on"
            )
        scores = {c: val[c][vbench]["score"]["mean"] for c in order}
        chosen = max(order, key=lambda c: (scores[c], overall[c], -order.index(c)))
        out[bench] = {"chosen": chosen, "validation_split": vbench, "validation": scores,
                      "mean_validation": overall}  # fmt: skip
    return out


def paired_vs_best_expert(
    table: dict[str, dict[str, Any]], best_expert: dict[str, Any], grids: Grids
) -> dict[str, Any]:
    """Per benchmark: every candidate minus the best single expert (chosen on validation),
    paired on the shared test items (bootstrap CI of the difference; exact McNemar p-value)."""
    out = {}
    for bench, choice in best_expert.items():
        best = choice["chosen"]
        ref = as_items(table[best][bench])
        out[bench] = {"best_expert": best, "vs": {}}
        for cand, recs in table.items():
            if cand != best and bench in recs:
                out[bench]["vs"][cand] = compare(as_items(recs[bench]), ref, metric="s",
                                                 n_boot=grids.bootstrap_samples, seed=grids.seed)  # fmt: skip
    return out


def as_items(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"item_id": k, "scores": {"s": v}} for k, v in record["per_item"].items()]
