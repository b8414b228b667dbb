"""Tests of the toy study's two explanations, instead of asserting them.

**1. Why do generative experts trained from scratch compose only partly?** The claim was that
the rule ``log p1 + log p2 − log p_b`` divides by the base's probabilities and so amplifies
tokens the base finds unlikely. Teacher-forced on the joint answer, at every answer position we
record the composed choice, the choice of the product of experts without the base
(``log p1 + log p2``), and ``log p_b`` of the chosen and of the correct token. If the claim holds,
the composition's errors are positions where the product of experts is right and the base term
turns it: ``log p_b(chosen)`` far below ``log p_b(correct)``. Two confounds are controlled: the
learning rate (from-scratch generative models used 1e-3, the aligned ones 3e-4: here the
*aligned* protocol is also trained at 1e-3) and the sequence length (the generative sequence is
``2L + 2`` tokens: here it is also trained and tested at L = 8, as long as an aligned L = 16).
Free-running generative rows are scored by ``mergelab.compare`` (:func:`generative_exact_match`).

**2. Why does a wrong base still compose?** At an input A, the A→B expert says B and the C→D
expert copies A; the composition prefers B over A iff ``d1 − d2 + db > 0`` with
``d1 = log p1(B) − log p1(A)``, ``d2 = log p2(A) − log p2(B)``, ``db = log p_b(A) − log p_b(B)``;
the product of experts alone iff ``d1 > d2``. The A→B expert never sees A as a target, so
``log p1(A)`` may be far below ``log p2(B)``: then ``d1 ≫ d2``, the product of experts decides
alone and any base will do. The **swap variant** keeps each source letter in its expert's output
alphabet (experts A↔B and C↔D: A is a target of the first expert, at input B), so ``d1 ≈ d2``
and only the base can break the tie: there a wrong base should fail.

    python -m studies.toy.explanations --seeds 0 1 2     # ~18 min per seed on a loaded 2-core box

Writes results/toy/explanations.json: config, per-seed records, and a summary (per-seed values
and a Student-t interval over seeds, :mod:`.summary`).
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from mergelab import ModelCandidate
from mergelab.compose import ComposedDecoder
from mergelab.compose.formula import Composition
from mergelab.results import json_with_keys, write_json_atomic
from mergelab.toy import (
    AlignedTask,
    GenerativeTask,
    LetterMap,
    build_char_tokenizer,
    parallel_target,
    random_strings,
)
from mergelab.toy.tasks import IGNORE

from .evaluate import (
    aligned_predictions,
    compare_letters,
    exact_match,
    letter_benchmarks,
    row_scores,
)
from .summary import experiment_parser, is_rate, resummarise, summarise
from .train import TrainConfig, tiny_gpt2, train_model

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"n_train": 2000, "n_test": 300}  # --n-train / --n-test shrink them for a smoke run
# Explanation 1: (label, protocol, training, length). The first is the study's own setting.
CONDITIONS = [
    ("generative, lr 1e-3, L=16", "generative", TrainConfig(epochs=5, batch_size=16, lr=1e-3), 16),
    ("aligned, lr 1e-3, L=16", "aligned", TrainConfig(epochs=5, batch_size=16, lr=1e-3), 16),
    ("generative, lr 1e-3, L=8", "generative", TrainConfig(epochs=5, batch_size=16, lr=1e-3), 8),
]
# Explanation 2: aligned, from scratch, the study's authors-protocol training.
ALIGNED = TrainConfig(epochs=5, batch_size=16, lr=3e-4)
EXPERT_PAIRS = {"A->B + C->D": ("A->B", "C->D"), "swap A<->B + C<->D": ("A->B,B->A", "C->D,D->C")}


class Recorder:
    """Collects records in the study's format (:func:`.summary.summarise` reads them)."""

    def __init__(self, seed: int):
        self.seed, self.records = seed, []

    def __call__(self, part, pair, method, metric, values):
        values = [float(v) for v in np.atleast_1d(np.asarray(values, dtype=float))]
        self.records.append(
            {
                "part": part,
                "pair": pair,
                "method": method,
                "kind": "probe",
                "seed": self.seed,
                "x": None,
                "metric": metric,
                "values": values,
            }
        )


@torch.no_grad()
def answer_logprobs(models: dict, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """``{name: [P, V]}`` log-probs of each model at the ``P`` scored positions, and ``target``.

    Every sequence has the same length (no padding). Scored positions are those with a label:
    the answer and EOS (generative) or every position (aligned).
    """
    mask = labels != IGNORE
    out = {k: torch.log_softmax(m(input_ids=input_ids).logits, -1)[mask] for k, m in models.items()}
    return out | {"target": labels[mask]}


def train_for(task, letter_map, cfg, length, seed, rng, tok):
    """A model trained from scratch on ``letter_map`` at ``length`` (data from ``rng``)."""
    xs = random_strings(SIZES["n_train"], length, rng)
    model = tiny_gpt2(len(tok), seed=seed)
    train_model(model, *task.encode(xs, [letter_map(x) for x in xs]), replace(cfg, seed=seed))
    return model


def explain_generative_failure(rec: Recorder, seed: int, tok) -> None:
    """Explanation 1: per-position anatomy of the composition's errors, three conditions."""
    maps = {"base": LetterMap(), "e1": LetterMap.parse("A->B"), "e2": LetterMap.parse("C->D")}
    for c, (label, protocol, cfg, length) in enumerate(CONDITIONS):
        task = GenerativeTask(tok) if protocol == "generative" else AlignedTask(tok)
        rng = random.Random(seed * 100 + c)
        models = {
            k: train_for(task, m, cfg, length, seed * 1000 + 500 + 10 * c + i, rng, tok)
            for i, (k, m) in enumerate(maps.items())
        }
        test = random_strings(SIZES["n_test"], length, random.Random(10_000 + seed))
        joint = [parallel_target([maps["e1"], maps["e2"]], x) for x in test]
        # Free-running success of each row, as in the study.
        rows = {
            "base alone (copy target)": ("base", None),
            "expert A->B alone (own target)": ("e1", None),
            "composition": (None, Composition.weighted("base", ["e1", "e2"])),
            "product of experts (no base)": (None, Composition.product_of_experts(["e1", "e2"])),
        }
        for name, (single, formula) in rows.items():
            if protocol == "generative":
                values = generative_exact_match(name, single, formula, models, maps, test, tok)
            else:
                if single is not None:
                    cand = ModelCandidate(models[single], tok, name=name)
                    target = [maps[single](x) for x in test]
                else:
                    pool = {k: models[k] for k in formula.components}
                    cand = ComposedDecoder.from_models(pool, formula, tok)
                    target = joint
                values = exact_match(aligned_predictions(cand, task, test), target)
            rec("generative failure", label, name, "exact match", values)
        # Teacher-forced anatomy on the joint target.
        lp = answer_logprobs(models, *task.encode(test, joint))
        comp = lp["e1"] + lp["e2"] - lp["base"]
        poe = lp["e1"] + lp["e2"]
        target, chosen = lp["target"], comp.argmax(-1)
        wrong = chosen != target
        idx = torch.arange(len(target))
        lpb_chosen, lpb_target = lp["base"][idx, chosen], lp["base"][idx, target]
        rec(
            "generative failure",
            label,
            "composition",
            "token error rate (teacher forced)",
            wrong.float().mean(),
        )
        rec(
            "generative failure",
            label,
            "product of experts",
            "token error rate (teacher forced)",
            (poe.argmax(-1) != target).float().mean(),
        )
        n_wrong = int(wrong.sum())
        rec("generative failure", label, "composition", "errors (count)", n_wrong)
        if n_wrong:
            w = wrong
            rec(
                "generative failure",
                label,
                "composition errors",
                "share where the product of experts is right",
                (poe.argmax(-1)[w] == target[w]).float().mean(),
            )
            rec(
                "generative failure",
                label,
                "composition errors",
                "median log p_b(chosen)",
                lpb_chosen[w].median(),
            )
            rec(
                "generative failure",
                label,
                "composition errors",
                "median log p_b(correct)",
                lpb_target[w].median(),
            )
            rec(
                "generative failure",
                label,
                "composition errors",
                "share with log p_b(chosen) < log p_b(correct)",
                (lpb_chosen[w] < lpb_target[w]).float().mean(),
            )
            eos = target == tok.eos_token_id
            rec(
                "generative failure",
                label,
                "composition errors",
                "share at the EOS position",
                eos[w].float().mean(),
            )
        # Reference: the base's log-prob of the composition's runner-up where it is right.
        runner_up = comp.topk(2, -1).indices[:, 1]
        rec(
            "generative failure",
            label,
            "composition (right positions)",
            "median log p_b(runner-up)",
            lp["base"][idx, runner_up][~wrong].median(),
        )


def generative_exact_match(name, single, formula, models, maps, test, tok) -> list[float]:
    """One generative row through mergelab.compare: the model ``single`` against its own map's
    target, or ``formula`` over ``models`` against the joint target of e1 and e2."""
    if single == "base":
        family, row, targets = {"family": "base"}, "base", [maps["base"]]
    elif single is not None:
        family = {"family": "expert", "experts": [single], "best_expert": False}
        row, targets = single, [maps[single]]
    else:
        family = {
            "family": "composition",
            "name": name,
            "experts": ["e1", "e2"],
            "composition": formula.to_dict(),
        }
        row, targets = name, [maps["e1"], maps["e2"]]
    benchmarks = letter_benchmarks(targets, test, skills=False, name="target")
    results = compare_letters(models, tok, [family], benchmarks, seed=0)  # greedy: no randomness
    return row_scores(results, row, "target")


def margins(lp: dict, rewriter: str, copier: str, src: int, dst: int, where: torch.Tensor) -> dict:
    """At positions ``where`` (input = ``src``): the terms that decide ``dst`` against ``src``."""
    d1 = lp[rewriter][where, dst] - lp[rewriter][where, src]
    d2 = lp[copier][where, src] - lp[copier][where, dst]
    return {
        "d1": d1,
        "d2": d2,
        "log p_rewriter(src)": lp[rewriter][where, src],
        "log p_copier(dst)": lp[copier][where, dst],
    }


def explain_wrong_base(rec: Recorder, seed: int, tok) -> None:
    """Explanation 2: margins at the source letters, and the swap variant where the base matters."""
    task = AlignedTask(tok)
    rng = random.Random(seed * 100 + 50)
    specs = {"identity base": LetterMap(), "shuffled-alphabet base": LetterMap.permutation(seed)}
    specs |= {s: LetterMap.parse(s) for pair in EXPERT_PAIRS.values() for s in pair}
    models = {
        k: train_for(task, m, ALIGNED, 16, seed * 1000 + 600 + i, rng, tok)
        for i, (k, m) in enumerate(specs.items())
    }
    models["untrained base"] = tiny_gpt2(len(tok), seed=seed * 1000 + 699)
    test = random_strings(SIZES["n_test"], 16, random.Random(10_000 + seed))
    ids = task.prompts(test)[0]
    for pair, (s1, s2) in EXPERT_PAIRS.items():
        m1, m2 = LetterMap.parse(s1), LetterMap.parse(s2)
        joint = [parallel_target([m1, m2], x) for x in test]
        for base in ("identity base", "untrained base", "shuffled-alphabet base", None):
            if base is None:
                name, formula, pool = (
                    "product of experts (no base)",
                    Composition.product_of_experts(["e1", "e2"]),
                    {},
                )
            else:
                name, formula, pool = (
                    f"composition ({base})",
                    Composition.weighted("base", ["e1", "e2"]),
                    {"base": models[base]},
                )
            cand = ComposedDecoder.from_models(
                pool | {"e1": models[s1], "e2": models[s2]}, formula, tok
            )
            preds = aligned_predictions(cand, task, test)
            rec("wrong base", pair, name, "joint exact match", exact_match(preds, joint))
        # Margins at every source letter of either expert, the other expert copying it.
        lp = answer_logprobs(
            {k: models[k] for k in specs} | {"untrained base": models["untrained base"]}, ids, ids
        )
        flat = ids.flatten()
        for rewriter, copier, lmap in ((s1, s2, m1), (s2, s1, m2)):
            for src, dst in lmap.pairs:
                a, b = tok.convert_tokens_to_ids([src, dst])
                where = flat == a
                terms = margins(lp, rewriter, copier, a, b, where)
                key = f"input {src}: {rewriter} writes {dst}, {copier} copies"
                for t in ("log p_rewriter(src)", "log p_copier(dst)"):
                    rec("wrong base margins", pair, key, f"median {t}", terms[t].median())
                rec(
                    "wrong base margins",
                    pair,
                    key,
                    "share d1 > d2 (product of experts picks the rewrite)",
                    (terms["d1"] > terms["d2"]).float().mean(),
                )
                rec(
                    "wrong base margins",
                    pair,
                    key,
                    "median d1 - d2",
                    (terms["d1"] - terms["d2"]).median(),
                )
                for base in ("identity base", "untrained base", "shuffled-alphabet base"):
                    db = lp[base][where, a] - lp[base][where, b]
                    rec("wrong base margins", pair, key, f"median db ({base})", db.median())
                    rec(
                        "wrong base margins",
                        pair,
                        key,
                        f"share d1 - d2 + db > 0 ({base})",
                        (terms["d1"] - terms["d2"] + db > 0).float().mean(),
                    )


def main(argv: list[str] | None = None) -> int:
    p = experiment_parser(
        __doc__.splitlines()[0], ROOT / "results" / "toy" / "explanations.json", SIZES
    )
    args = p.parse_args(argv)
    if args.resummarise:
        resummarise(args.out)
        return 0
    SIZES.update(n_train=args.n_train, n_test=args.n_test)
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    runs, t0 = [], time.perf_counter()
    for seed in args.seeds:
        torch.manual_seed(seed)
        rec = Recorder(seed)
        explain_generative_failure(rec, seed, tok)
        explain_wrong_base(rec, seed, tok)
        runs.append({"seed": seed, "records": rec.records})
        print(f"seed {seed} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    config = {
        **SIZES,
        "seeds": args.seeds,
        "aligned": ALIGNED.to_dict(),
        "conditions": [(c[0], c[1], c[2].to_dict(), c[3]) for c in CONDITIONS],
        "expert_pairs": EXPERT_PAIRS,
    }
    result = {
        "config": config,
        "runs": runs,
        "summary": summarise(runs, is_rate),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    write_json_atomic(
        args.out, result, indent=1, written_by_mergelab=json_with_keys("config", "runs")
    )
    for r in result["summary"]:
        seeds = " ".join(f"{v:.3g}" for v in r["per_seed"])
        print(
            f"{r['part']:<20} {r['pair']:<26} {r['method'][:50]:<50} {r['metric'][:55]:<55} {r['mean']:.3g} ({seeds})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
