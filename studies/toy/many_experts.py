"""Three and four experts on the toy task: does what works for two keep working?

Experts rewrite one letter each, with disjoint letters (two letter sets, so the result is not one
alphabet's accident). For each set, every subset of 2, 3 and 4 experts is composed with the
paper's rule ``Σ_i log p_i − (k − 1) log p_b`` and scored on its parallel joint target, in three
conditions: aligned protocol with every model from scratch, aligned with experts fully
fine-tuned from the base, and generative (``x [SEP] y [EOS]``, greedy until EOS) with experts
fine-tuned from the generative base (first letter set only). Task arithmetic (λ = 1) of the
fine-tuned experts is a row too. Generative rows are scored by ``mergelab.compare``, one
comparison per subset (:func:`.evaluate.compare_letters`).

Diagnostics, teacher forced on the joint target, explain failures where they occur. At a
position whose letter expert j rewrites (``src → dst``), the composition prefers ``dst`` iff
``d_j > Σ_{i≠j} (d_i − d_b)``, with ``d = log p(src) − log p(dst)`` of each model (``d_j`` is
negative: the rewriting expert's margin is ``−d_j``); the right side is the *copiers' excess
confidence* over the base, which grows with the number of copiers. Recorded: the share of such
positions where the composition is right, the medians of ``−d_j`` and of the copiers' excess,
the token error rate split by where the error is (rewritten letter, copied letter, EOS), and
how many experts are active (KL(p_i‖p_b) > 0.1 nats) at the errors.

    python -m studies.toy.many_experts --seeds 0 1 2     # ~20 min per seed on a loaded 2-core box

Writes results/toy/many_experts.json (config, per-seed records, summary: per-seed values and a
Student-t interval over seeds), rewritten after each seed.
"""

from __future__ import annotations

import itertools
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from mergelab import ModelCandidate
from mergelab.compose import ComposedDecoder
from mergelab.compose.diagnostics import kl_divergence
from mergelab.merge import merge_models
from mergelab.results import json_with_keys, write_json_atomic
from mergelab.toy import (
    AlignedTask,
    GenerativeTask,
    LetterMap,
    build_char_tokenizer,
    parallel_target,
    random_strings,
)

from .evaluate import (
    aligned_predictions,
    compare_letters,
    exact_match,
    letter_benchmarks,
    row_scores,
)
from .explanations import answer_logprobs
from .summary import experiment_parser, is_rate, resummarise, summarise
from .train import TrainConfig, finetune_full, tiny_gpt2, train_model

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"n_train": 2000, "n_test": 300, "length": 16}
LETTER_SETS = {
    "set 1": ["A->B", "C->D", "E->F", "G->H"],
    "set 2": ["A->K", "M->B", "Q->Z", "X->E"],
}
# The toy study's fast settings for each protocol.
TRAINING = {
    "aligned scratch": TrainConfig(epochs=5, batch_size=16, lr=3e-4),
    "aligned finetune": TrainConfig(epochs=2, batch_size=16, lr=3e-4),
    "generative scratch": TrainConfig(epochs=5, batch_size=16, lr=1e-3),
    "generative finetune": TrainConfig(epochs=2, batch_size=16, lr=1e-3),
}


class Models:
    """Trains the models of one seed; every model gets the next seed of the stream."""

    def __init__(self, seed: int, tok):
        self.tok, self.rng, self.next = tok, random.Random(seed), seed * 1000 + 800

    def data(self, task, letter_map):
        xs = random_strings(SIZES["n_train"], SIZES["length"], self.rng)
        return task.encode(xs, [letter_map(x) for x in xs])

    def scratch(self, task, letter_map, cfg):
        self.next += 1
        model = tiny_gpt2(len(self.tok), seed=self.next)
        train_model(model, *self.data(task, letter_map), replace(cfg, seed=self.next))
        return model

    def finetune(self, base, task, letter_map, cfg):
        self.next += 1
        return finetune_full(base, *self.data(task, letter_map), replace(cfg, seed=self.next))


def anatomy(lp: dict, names: list[str], maps: list[LetterMap], inputs: list[str], tok) -> dict:
    """Per-position diagnostics of the composition of ``names`` (see the module docstring).

    ``lp`` is :func:`.explanations.answer_logprobs` of base and experts; its positions are, per
    input, one per letter (the output at that letter) and, if ``lp["eos"]``, then EOS.
    """
    k = len(names)
    comp = sum(lp[n] for n in names) - (k - 1) * lp["base"]
    target, chosen = lp["target"], comp.argmax(-1)
    wrong = chosen != target
    # Per position: which expert rewrites its input letter (-1: none, k: the EOS position).
    eos = [k] if lp["eos"] else []
    owner = torch.tensor([o for x in inputs for o in [_owner(c, maps) for c in x] + eos])
    letter = torch.tensor(
        [i for x in inputs for i in tok.convert_tokens_to_ids(list(x)) + [-1] * len(eos)]
    )
    active = torch.stack([kl_divergence(lp[n], lp["base"]) > 0.1 for n in names]).sum(0)
    n_wrong = max(1, int(wrong.sum()))
    out = {
        "token error rate": wrong.float().mean(),
        "error share at rewritten letters": (wrong & (owner >= 0) & (owner < k)).sum() / n_wrong,
        "error share at copied letters": (wrong & (owner == -1)).sum() / n_wrong,
        "error share at EOS": (wrong & (owner == k)).sum() / n_wrong,
        "mean active experts (all positions)": active.float().mean(),
    }
    if wrong.any():
        out["mean active experts (errors)"] = active[wrong].float().mean()
    # Rewrite positions: the rewriting expert's margin against the copiers' excess confidence.
    own_margin, excess, right = [], [], []
    for j, m in enumerate(maps):
        for src, dst in m.pairs:
            a, b = tok.convert_tokens_to_ids([src, dst])
            where = (owner == j) & (letter == a)
            if not where.any():
                continue
            d = {n: lp[n][where, a] - lp[n][where, b] for n in [*names, "base"]}
            own_margin.append(-d[names[j]])
            excess.append(sum(d[n] - d["base"] for i, n in enumerate(names) if i != j))
            right.append(chosen[where] == b)
    if own_margin:
        margin, extra = torch.cat(own_margin), torch.cat(excess)
        out["rewrites right"] = torch.cat(right).float().mean()
        out["median rewriting margin -d_j"] = margin.median()
        out["median copiers' excess"] = extra.median()
        out["share copiers' excess > margin"] = (extra > margin).float().mean()
    return {key: float(v) for key, v in out.items()}


def _owner(c: str, maps: list[LetterMap]) -> int:
    return next((j for j, m in enumerate(maps) if m.touches(c)), -1)


def run_condition(rec, condition, task, base, experts: dict, maps: dict, test, tok, merges):
    """Every subset of 2..4 experts: composition (and task arithmetic) joint exact match + anatomy."""
    generative = isinstance(task, GenerativeTask)
    names = list(experts)
    for k in range(2, len(names) + 1):
        for subset in itertools.combinations(names, k):
            sub_maps = [maps[n] for n in subset]
            joint = [parallel_target(sub_maps, x) for x in test]
            if generative:  # through mergelab.compare (studies/toy/evaluate.py)
                families = [{"family": "composition", "name": "composition"}]
                if merges:
                    families.append(
                        {
                            "family": "merge",
                            "name": "task arithmetic λ=1",
                            "method": "task_arithmetic",
                            "params": {"lambda": 1.0},
                        }
                    )
                results = compare_letters(
                    {"base": base} | {n: experts[n] for n in subset},
                    tok,
                    families,
                    letter_benchmarks(sub_maps, test, skills=False),
                    seed=0,  # nothing random: greedy decoding, task arithmetic
                )
                scores = {f["name"]: row_scores(results, f["name"], "joint") for f in families}
            else:
                rows = {"composition": ComposedDecoder(base, [experts[n] for n in subset], tok)}
                if merges:
                    merged = merge_models(
                        "task_arithmetic",
                        base,
                        [experts[n] for n in subset],
                        params={"lambda_": 1.0},
                    )
                    rows["task arithmetic λ=1"] = ModelCandidate(merged, tok)
                scores = {
                    method: exact_match(aligned_predictions(cand, task, test), joint)
                    for method, cand in rows.items()
                }
            for method, values in scores.items():
                rec(condition, " + ".join(subset), method, "joint exact match", k, values)
            models = {"base": base} | {n: experts[n] for n in subset}
            lp = answer_logprobs(models, *task.encode(test, joint)) | {"eos": generative}
            for metric, value in anatomy(lp, list(subset), sub_maps, test, tok).items():
                rec(condition, " + ".join(subset), "composition", metric, k, value)


def run_seed(seed: int, tok) -> list[dict]:
    records: list[dict] = []

    def rec(part, pair, method, metric, k, values):
        values = [float(v) for v in np.atleast_1d(np.asarray(values, dtype=float))]
        records.append(
            {
                "part": part,
                "pair": pair,
                "method": method,
                "kind": "many experts",
                "seed": seed,
                "x": k,
                "metric": metric,
                "values": values,
            }
        )

    torch.manual_seed(seed)
    train = Models(seed, tok)
    aligned, generative = AlignedTask(tok), GenerativeTask(tok)
    test = random_strings(SIZES["n_test"], SIZES["length"], random.Random(10_000 + seed))
    base = train.scratch(aligned, LetterMap(), TRAINING["aligned scratch"])
    for set_name, specs in LETTER_SETS.items():
        maps = {s: LetterMap.parse(s) for s in specs}
        scratch = {
            s: train.scratch(aligned, m, TRAINING["aligned scratch"]) for s, m in maps.items()
        }
        run_condition(
            rec,
            f"aligned, from scratch, {set_name}",
            aligned,
            base,
            scratch,
            maps,
            test,
            tok,
            merges=False,
        )
        tuned = {
            s: train.finetune(base, aligned, m, TRAINING["aligned finetune"])
            for s, m in maps.items()
        }
        run_condition(
            rec,
            f"aligned, fine-tuned, {set_name}",
            aligned,
            base,
            tuned,
            maps,
            test,
            tok,
            merges=True,
        )
    maps = {s: LetterMap.parse(s) for s in LETTER_SETS["set 1"]}
    gbase = train.scratch(generative, LetterMap(), TRAINING["generative scratch"])
    gtuned = {
        s: train.finetune(gbase, generative, m, TRAINING["generative finetune"])
        for s, m in maps.items()
    }
    run_condition(
        rec,
        "generative, fine-tuned, set 1",
        generative,
        gbase,
        gtuned,
        maps,
        test,
        tok,
        merges=True,
    )
    return records


def main(argv: list[str] | None = None) -> int:
    p = experiment_parser(
        __doc__.splitlines()[0], ROOT / "results" / "toy" / "many_experts.json", SIZES
    )
    args = p.parse_args(argv)
    if args.resummarise:
        resummarise(args.out)
        return 0
    SIZES.update(n_train=args.n_train, n_test=args.n_test)
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    config = {
        **SIZES,
        "letter_sets": LETTER_SETS,
        "training": {k: v.to_dict() for k, v in TRAINING.items()},
    }
    runs, t0 = [], time.perf_counter()
    for seed in args.seeds:
        runs.append({"seed": seed, "records": run_seed(seed, tok)})
        result = {
            "config": config | {"seeds": [r["seed"] for r in runs]},
            "runs": runs,
            "summary": summarise(runs, is_rate),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        write_json_atomic(
            args.out, result, indent=1, written_by_mergelab=json_with_keys("config", "runs")
        )  # after each seed: a partial run is usable
        print(f"seed {seed} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    for r in result["summary"]:
        if r["metric"] == "joint exact match":
            seeds = " ".join(f"{100 * v:.1f}" for v in r["per_seed"])
            print(
                f"{r['part']:<34} k={r['x']} {r['pair']:<32} {r['method']:<20} {100 * r['mean']:6.1f} ({seeds})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
