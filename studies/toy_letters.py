"""Toy studies: letter replacement, sequential span skills, length generalisation, failures.

Logit composition (docs/composition.md) next to the weight merges the paper did not run, on tiny GPT-2
models trained here on CPU. Every row — base, expert, composition, each merge — is a
``mergelab.candidate.Candidate`` evaluated by the same calls (``mergelab.toy.evaluate``).

Parts (each seed runs all of them):

1. authors     aligned protocol, every model from scratch: base = identity, experts A→B, C→D
               and the authors' code's A→K, M→B. Base, experts, composition.
2. generative  ``x [SEP] y [EOS]``, greedy decoding until EOS; experts from scratch, and experts
               fine-tuned from the generative base (then the weight merges are rows too).
3. shared      experts fine-tuned from the base (full and LoRA) so that task arithmetic (λ grid),
               TIES, DARE, linear averaging and SLERP are meaningful next to the composition.
4. length      trained at length 16, tested at lengths 1..64 (parts 1–3).
5. spans       sequential skills with stopping times: shift letters inside <…>, mirror them
               inside (…); base copies. Success as the two spans' overlap grows.
6. failure     the cases the theory predicts: two experts on the same letter (A→B with A→C), a
               chain (A→B with B→C), a wrong base (untrained; trained on a shuffled alphabet).
7. diagnostics per-token expert activity (KL to the base) and co-activity vs composition success.

Run:
    python studies/toy_letters.py              # fast default: ~430 s of CPU on one thread
                                               # (15 min wall on a shared, loaded 2-core box)
    python studies/toy_letters.py --full       # authors' settings (batch 1), 5 seeds, all lengths
    python studies/toy_letters.py --plot-only  # redraw figures from results/toy/<setting>/

``studies/toy_authors_exact.py`` runs part 1 alone at the authors' exact settings (batch 1).
Threads: 1 by default; on a busy machine 2 intra-op threads made training ~10x slower.

Outputs: results/toy/<fast|full>/{config.json, seed_<s>.json, summary.csv, summary.json};
figures/toy_*.png (fast) or figures/toy_full_*.png, drawn from summary.json only. Finished seeds
are kept and reused (resume); ``--force`` recomputes them.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from mergelab.compose import ComposedDecoder, ModelCandidate  # noqa: E402
from mergelab.merge import list_merge_methods, merge_models  # noqa: E402
from mergelab.outputs import atomic_output_file  # noqa: E402
from mergelab.toy import (  # noqa: E402
    AlignedTask,
    GenerativeTask,
    LetterMap,
    TrainConfig,
    build_char_tokenizer,
    exact_match,
    finetune_lora,
    parallel_target,
    random_strings,
    seed_bootstrap_ci,
    skill_success,
    tiny_gpt2,
    train_model,
)
from mergelab.toy.evaluate import aligned_predictions, generative_predictions  # noqa: E402
from mergelab.toy.tasks import SPAN_MARKERS, SpanSkillTask  # noqa: E402
from mergelab.toy.train import finetune_full  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ============================================================================================
# Settings


@dataclass
class Settings:
    name: str = "fast"
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    n_train: int = 2000  # examples per model (authors: 2000)
    train_length: int = 16  # authors: 16
    n_test: int = 300  # test strings per seed at the trained length
    n_test_per_length: int = 60  # per length in the length sweep
    lengths: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 12, 16, 20, 24, 32, 48, 64])
    # Authors: AdamW lr 3e-4, batch 1, 5 epochs. Fast: batch 16 (same lr, epochs) — still 100%.
    scratch: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=5, batch_size=16))
    # Generative models from scratch: copying across the separator needs more updates than
    # the aligned map; lr 1e-3 reaches 100% at length 16 in 5 epochs of batch 16. Trained at
    # exactly length 16 (lengths 1..16 mixed reached only 66% teacher-forced in 15 epochs).
    generative: TrainConfig = field(
        default_factory=lambda: TrainConfig(epochs=5, batch_size=16, lr=1e-3)
    )
    generative_finetune: TrainConfig = field(
        default_factory=lambda: TrainConfig(epochs=2, batch_size=16, lr=1e-3)
    )
    finetune: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=2, batch_size=16))
    lora: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=3, batch_size=16, lr=3e-3))
    lora_rank: int = 4
    spans_base: TrainConfig = field(
        default_factory=lambda: TrainConfig(epochs=6, batch_size=16, lr=1e-3)
    )
    spans_finetune: TrainConfig = field(
        default_factory=lambda: TrainConfig(epochs=4, batch_size=16, lr=1e-3)
    )
    span_letters: int = 12
    span_width: int = 4  # letters per span in the overlap sweep (overlap 0..span_width)
    n_span_test: int = 150  # per overlap value
    lambdas: list[float] = field(default_factory=lambda: [0.5, 1.0, 1.5, 2.0])

    def to_dict(self) -> dict:
        return asdict(self)


def full_settings() -> Settings:
    authors = TrainConfig(epochs=5, batch_size=1, lr=3e-4)
    return Settings(
        name="full",
        seeds=[0, 1, 2, 3, 4],
        n_test=1000,
        n_test_per_length=200,
        lengths=list(range(1, 65)),
        scratch=authors,
        generative=TrainConfig(epochs=5, batch_size=4, lr=1e-3),
        generative_finetune=TrainConfig(epochs=2, batch_size=4, lr=1e-3),
        finetune=TrainConfig(epochs=2, batch_size=1, lr=3e-4),
        lora=TrainConfig(epochs=3, batch_size=4, lr=3e-3),
        n_span_test=500,
    )


# The weight merges compared with the composition (all on experts fine-tuned from one base).
# (label, method, params, use_base); "linear" and "slerp" interpolate the two experts.
def merge_grid(lambdas: list[float]) -> list[tuple[str, str, dict, bool]]:
    grid = [(f"TA λ={lam:g}", "task_arithmetic", {"lambda_": lam}, True) for lam in lambdas]
    grid += [
        ("TIES d=0.2", "ties", {"density": 0.2, "lambda_": 1.0}, True),
        ("TIES d=0.5", "ties", {"density": 0.5, "lambda_": 1.0}, True),
        ("DARE-lin d=0.5", "dare_linear", {"density": 0.5, "lambda_": 1.0}, True),
        ("DARE-TIES d=0.5", "dare_ties", {"density": 0.5, "lambda_": 1.0}, True),
        ("linear avg", "linear", {}, False),
        ("SLERP t=0.5", "slerp", {"t": 0.5}, False),
    ]
    have = set(list_merge_methods())
    return [g for g in grid if g[1] in have]


# ============================================================================================
# Building blocks: train a model for a letter map, build candidates, record results


class Study:
    """Holds the tokenizers and settings of one run and collects result records."""

    def __init__(self, settings: Settings, seed: int):
        self.s = settings
        self.seed = seed
        self.rng = random.Random(seed)
        self.tok = build_char_tokenizer()
        self.span_tok = build_char_tokenizer(SPAN_MARKERS)
        self.aligned = AlignedTask(self.tok)
        self.generative = GenerativeTask(self.tok)
        self.records: list[dict] = []
        self.timings: dict[str, float] = {}
        self._model_seed = seed * 1000

    # ---- training ----------------------------------------------------------------------
    def next_seed(self) -> int:
        self._model_seed += 1
        return self._model_seed

    def train_data(self, task, fn, length) -> tuple[torch.Tensor, torch.Tensor]:
        xs = random_strings(self.s.n_train, length, self.rng)
        return task.encode(xs, [fn(x) for x in xs])

    def scratch(self, letter_map: LetterMap, *, generative: bool = False):
        """A model trained from scratch to perform ``letter_map`` (identity = the base)."""
        task = self.generative if generative else self.aligned
        cfg = replace(self.s.generative if generative else self.s.scratch, seed=self.next_seed())
        model = tiny_gpt2(len(self.tok), seed=cfg.seed)
        train_model(model, *self.train_data(task, letter_map, self.s.train_length), cfg)
        return model

    def finetuned(self, base, letter_map: LetterMap, *, lora: bool = False):
        data = self.train_data(self.aligned, letter_map, self.s.train_length)
        if lora:
            cfg = replace(self.s.lora, seed=self.next_seed())
            return finetune_lora(base, *data, cfg, rank=self.s.lora_rank)[0]
        return finetune_full(base, *data, replace(self.s.finetune, seed=self.next_seed()))[0]

    # ---- candidates --------------------------------------------------------------------
    def single(self, model, name, tok=None):
        return ModelCandidate(model, tok or self.tok, name=name)

    def composed(self, base, experts, names, tok=None, name="composition"):
        return ComposedDecoder(base, experts, tok or self.tok, expert_names=list(names), name=name)

    def merges(self, base, experts) -> dict[str, torch.nn.Module]:
        out = {}
        for label, method, params, use_base in merge_grid(self.s.lambdas):
            out[label] = merge_models(
                method, base if use_base else None, experts, params=params, seed=self.seed
            )
        return out

    # ---- recording ---------------------------------------------------------------------
    def record(self, part, pair, method, kind, metric, values, x=None):
        self.records.append(
            {
                "part": part,
                "pair": pair,
                "method": method,
                "kind": kind,
                "seed": self.seed,
                "x": x,
                "metric": metric,
                "values": [float(v) for v in np.asarray(values).tolist()],
            }
        )

    def eval_letters(self, part, maps, candidates, inputs, *, generative=False, x=None):
        """Joint exact match (parallel and chain targets) and per-skill success for each row."""
        pair = " + ".join(m.name for m in maps)
        parallel = [parallel_target(maps, s) for s in inputs]
        chained = [LetterMap.chain(maps, s) for s in inputs]
        for kind, cand in candidates:
            if generative:
                preds = generative_predictions(cand, self.generative, inputs)
            else:
                preds = aligned_predictions(cand, self.aligned, inputs)
            self.record(part, pair, cand.name, kind, "joint", exact_match(preds, parallel), x)
            if parallel != chained and None not in parallel:  # a true chain (A->B, B->C)
                self.record(part, pair, cand.name, kind, "chain", exact_match(preds, chained), x)
            if x is not None:
                continue
            safe = [p if p is not None else "" for p in preds]
            for m in maps:
                self.record(
                    part, pair, cand.name, kind, f"skill {m.name}", skill_success(inputs, safe, m)
                )
            # What happens on letters two experts both rewrite (conflict case only).
            for letter in {a for a, _ in maps[0].pairs} & {a for m in maps[1:] for a, _ in m.pairs}:
                outs = [
                    p[i]
                    for s, p in zip(inputs, safe)
                    for i, c in enumerate(s)
                    if c == letter and len(p) == len(s)
                ]
                for m in maps:
                    self.record(
                        part,
                        pair,
                        cand.name,
                        kind,
                        f"{letter} written as {m(letter)}",
                        [o == m(letter) for o in outs],
                    )
                self.record(
                    part, pair, cand.name, kind, f"{letter} kept", [o == letter for o in outs]
                )

    def tick(self, label, t0):
        self.timings[label] = round(time.perf_counter() - t0, 2)


# ============================================================================================
# The parts


def part_authors_and_failures(st: Study, test: list[str]) -> dict:
    """Parts 1 and 6 (from scratch): authors' pairs, conflict, chain, wrong base."""
    t0 = time.perf_counter()
    maps = {k: LetterMap.parse(k) for k in ["A->B", "C->D", "A->K", "M->B", "A->C", "B->C"]}
    base = st.scratch(LetterMap())
    experts = {
        k: st.scratch(m) for k, m in tqdm(maps.items(), desc="  scratch experts", leave=False)
    }
    st.tick("train scratch (base + 6 experts)", t0)
    t0 = time.perf_counter()
    pairs = {
        "authors": [("A->B", "C->D"), ("A->K", "M->B")],
        "failure": [("A->B", "A->C"), ("A->B", "B->C")],
    }
    for part, plist in pairs.items():
        for a, b in plist:
            rows = [("base", st.single(base, "base"))]
            rows += [("expert", st.single(experts[k], f"expert {k}")) for k in (a, b)]
            rows += [("composition", st.composed(base, [experts[a], experts[b]], [a, b]))]
            st.eval_letters(part, [maps[a], maps[b]], rows, test)
    # Wrong base: composition of the A->B and C->D experts over an untrained / shuffled base.
    wrong = {
        "untrained base": tiny_gpt2(len(st.tok), seed=st.next_seed()),
        "shuffled-alphabet base": st.scratch(LetterMap.permutation(st.seed)),
    }
    for label, wb in wrong.items():
        cand = st.composed(
            wb, [experts["A->B"], experts["C->D"]], ["A->B", "C->D"], name=f"composition ({label})"
        )
        st.eval_letters("failure", [maps["A->B"], maps["C->D"]], [("composition", cand)], test)
    st.tick("eval scratch", t0)
    return {"base": base, "experts": experts, "wrong": wrong, "maps": maps}


def part_shared(st: Study, base, test: list[str]) -> dict:
    """Part 3: experts fine-tuned from the base (full and LoRA), every merge next to composition."""
    maps = {k: LetterMap.parse(k) for k in ["A->B", "C->D", "A->C", "B->C"]}
    out = {}
    for variant in ("full", "lora"):
        t0 = time.perf_counter()
        keys = list(maps) if variant == "full" else ["A->B", "C->D"]
        experts = {k: st.finetuned(base, maps[k], lora=variant == "lora") for k in keys}
        st.tick(f"finetune {variant}", t0)
        t0 = time.perf_counter()
        plist = [("A->B", "C->D")] + (
            [("A->B", "A->C"), ("A->B", "B->C")] if variant == "full" else []
        )
        for a, b in plist:
            part = (
                f"shared-{variant}" if (a, b) == ("A->B", "C->D") else f"failure-shared-{variant}"
            )
            pair_models = [experts[a], experts[b]]
            merged = st.merges(base, pair_models)
            rows = [("base", st.single(base, "base"))]
            rows += [("expert", st.single(experts[k], f"expert {k}")) for k in (a, b)]
            rows += [("composition", st.composed(base, pair_models, [a, b]))]
            rows += [("merge", st.single(m, label)) for label, m in merged.items()]
            st.eval_letters(part, [maps[a], maps[b]], rows, test)
            if (a, b) == ("A->B", "C->D"):
                out[variant] = {"experts": pair_models, "merges": merged}
        st.tick(f"eval shared-{variant}", t0)
    return out


def part_generative(st: Study, test: list[str]) -> dict:
    """Part 2: generative protocol, greedy decoding until EOS.

    Experts from scratch (as in the authors' protocol) and experts fine-tuned from the
    generative base (shared initialisation, so the weight merges are rows too).
    """
    t0 = time.perf_counter()
    maps = [LetterMap.parse("A->B"), LetterMap.parse("C->D")]
    names = [m.name for m in maps]
    base = st.scratch(LetterMap(), generative=True)
    scratch = [st.scratch(m, generative=True) for m in maps]
    tuned = [
        finetune_full(
            base,
            *st.train_data(st.generative, m, st.s.train_length),
            replace(st.s.generative_finetune, seed=st.next_seed()),
        )[0]
        for m in maps
    ]
    st.tick("train generative", t0)
    t0 = time.perf_counter()
    rows = [("base", st.single(base, "base"))]
    rows += [("expert", st.single(e, f"expert {n}")) for e, n in zip(scratch, names)]
    rows += [("composition", st.composed(base, scratch, names))]
    st.eval_letters("generative", maps, rows, test, generative=True)
    merged = st.merges(base, tuned)
    shared_rows = [("base", st.single(base, "base"))]
    shared_rows += [("expert", st.single(e, f"expert {n}")) for e, n in zip(tuned, names)]
    shared_rows += [("composition", st.composed(base, tuned, names))]
    shared_rows += [("merge", st.single(m, label)) for label, m in merged.items()]
    st.eval_letters("generative-shared", maps, shared_rows, test, generative=True)
    st.tick("eval generative", t0)
    length_rows = [
        ("base", rows[0][1]),
        ("composition", st.composed(base, scratch, names, name="composition (scratch experts)")),
        ("composition", st.composed(base, tuned, names, name="composition (fine-tuned experts)")),
    ] + [("merge", st.single(merged[k], f"{k} (fine-tuned)")) for k in ("TA λ=1",) if k in merged]
    return {"rows": length_rows, "maps": maps, "base": base, "scratch": scratch, "tuned": tuned}


def part_length(st: Study, scratch: dict, shared: dict, generative: dict) -> None:
    """Part 4: joint success at lengths 1..64 (trained at 16) for each protocol's main rows."""
    t0 = time.perf_counter()
    ab_cd = [scratch["maps"]["A->B"], scratch["maps"]["C->D"]]
    base = scratch["base"]
    e = scratch["experts"]
    plans = {
        "length-authors": [
            ("base", st.single(base, "base")),
            ("expert", st.single(e["A->B"], "expert A->B")),
            ("composition", st.composed(base, [e["A->B"], e["C->D"]], ["A->B", "C->D"])),
        ],
        "length-shared-full": [
            ("composition", st.composed(base, shared["full"]["experts"], ["A->B", "C->D"])),
        ]
        + [
            ("merge", st.single(shared["full"]["merges"][k], k))
            for k in ("TA λ=1", "TIES d=0.2", "linear avg")
            if k in shared["full"]["merges"]
        ],
    }
    rng = random.Random(st.seed + 777)
    for length in tqdm(st.s.lengths, desc="  lengths", leave=False):
        inputs = random_strings(st.s.n_test_per_length, length, rng)
        for part, rows in plans.items():
            st.eval_letters(part, ab_cd, rows, inputs, x=length)
        st.eval_letters(
            "length-generative",
            generative["maps"],
            generative["rows"],
            inputs,
            generative=True,
            x=length,
        )
    st.tick("length sweep", t0)


def part_spans(st: Study) -> dict:
    """Part 5: span skills with stopping times; success vs overlap of the two spans."""
    t0 = time.perf_counter()
    task = SpanSkillTask(n_letters=st.s.span_letters)
    enc = AlignedTask(st.span_tok)
    skills = task.skills

    def data(active):
        ex = task.sample_random(st.s.n_train, st.rng)
        return enc.encode(
            [e.render(skills, []) for e in ex], [e.render(skills, active) for e in ex]
        )

    cfg = replace(st.s.spans_base, seed=st.next_seed())
    base = tiny_gpt2(len(st.span_tok), seed=cfg.seed)
    train_model(base, *data([]), cfg)
    experts = [
        finetune_full(base, *data([sk]), replace(st.s.spans_finetune, seed=st.next_seed()))[0]
        for sk in skills
    ]
    st.tick("train spans", t0)
    t0 = time.perf_counter()
    names = [sk.name for sk in skills]
    merged = st.merges(base, experts)
    rows = [("base", st.single(base, "base", st.span_tok))]
    rows += [("expert", st.single(m, f"expert {n}", st.span_tok)) for m, n in zip(experts, names)]
    rows += [("composition", st.composed(base, experts, names, st.span_tok))]
    rows += [
        ("merge", st.single(merged[k], k, st.span_tok))
        for k in ("TA λ=1", "TIES d=0.2", "linear avg")
        if k in merged
    ]
    rng = random.Random(st.seed + 555)
    pair = " + ".join(names)
    for k in range(st.s.span_width + 1):
        ex = task.sample_with_overlap(st.s.n_span_test, k, st.s.span_width, rng)
        inputs = [e.render(skills, []) for e in ex]
        joint = [e.render(skills, skills) for e in ex]
        for kind, cand in rows:
            preds = aligned_predictions(cand, enc, inputs)
            st.record("spans", pair, cand.name, kind, "joint", exact_match(preds, joint), k)
            # Outside the overlap every position has one correct answer whichever order the
            # skills are applied in: score those positions alone.
            outside = []
            for e, p, y in zip(ex, preds, joint):
                mask = _overlap_mask(e, skills)
                outside.append(all(pc == yc for pc, yc, m in zip(p, y, mask) if not m))
            st.record("spans", pair, cand.name, kind, "outside overlap", outside, k)
    st.tick("eval spans", t0)
    return {"base": base, "experts": experts, "task": task}


def _overlap_mask(example, skills) -> list[bool]:
    """Per character of the rendered string: is it a letter inside every span?"""
    mask = []
    for i, _c in enumerate(example.letters):
        for _sk, (s, _) in zip(skills, example.spans):
            if s == i:
                mask.append(False)
        mask.append(all(s <= i < e for s, e in example.spans))
        for _sk, (_, e) in zip(skills, example.spans):
            if e - 1 == i:
                mask.append(False)
    return mask


def part_diagnostics(
    st: Study, scratch: dict, shared: dict, generative: dict, spans: dict, test: list[str]
) -> None:
    """Part 7: per-token expert activity KL(p_i‖p_b) and co-activity for every composed pair.

    ``mergelab.compose.diagnostics`` scores the positions that predict a *following* token (the
    LM convention). In the aligned protocol position t predicts y[t], so one filler character is
    appended to each input: causal attention keeps it from changing any earlier position, and
    every real position gets scored.
    """
    from mergelab.compose.diagnostics import composition_diagnostics

    t0 = time.perf_counter()
    e = scratch["experts"]
    cases = [
        ("authors", "A->B + C->D", scratch["base"], [e["A->B"], e["C->D"]]),
        ("authors", "A->K + M->B", scratch["base"], [e["A->K"], e["M->B"]]),
        ("failure", "A->B + A->C", scratch["base"], [e["A->B"], e["A->C"]]),
        ("failure", "A->B + B->C", scratch["base"], [e["A->B"], e["B->C"]]),
        ("shared-full", "A->B + C->D", scratch["base"], shared["full"]["experts"]),
        ("shared-lora", "A->B + C->D", scratch["base"], shared["lora"]["experts"]),
    ]
    for label, wb in scratch["wrong"].items():
        cases.append(("failure", f"A->B + C->D ({label})", wb, [e["A->B"], e["C->D"]]))
    texts = [x + " " for x in test]

    def record(part, pair, decoder, texts, continuations=None, x=None):
        rep = composition_diagnostics(decoder, texts, continuations, batch_size=64)
        pair_key = "e1&e2"
        for t in rep.thresholds:
            k = f"{t:g}"
            st.record(
                part,
                pair,
                "diagnostics",
                "diagnostic",
                f"co-active@{k}",
                [rep.coactive_fraction[pair_key][k]],
                x,
            )
            for name in rep.experts:
                st.record(
                    part,
                    pair,
                    "diagnostics",
                    "diagnostic",
                    f"{name} active@{k}",
                    [rep.active_fraction[name][k]],
                    x,
                )
        st.record(
            part,
            pair,
            "diagnostics",
            "diagnostic",
            "composed top-1 differs",
            [rep.composed_top1_differs_fraction],
            x,
        )

    for part, pair, base, experts in cases:
        record(part, pair, st.composed(base, experts, ["e1", "e2"]), texts)
    # Generative: teacher forced on the joint answer after "x [SEP]".
    maps = generative["maps"]
    prompts = [st.generative.prompt(x) for x in test]
    answers = [parallel_target(maps, x) + st.tok.eos_token for x in test]
    for part, experts in (
        ("generative", generative["scratch"]),
        ("generative-shared", generative["tuned"]),
    ):
        record(
            part,
            "A->B + C->D",
            st.composed(generative["base"], experts, ["e1", "e2"]),
            prompts,
            answers,
        )
    # Span pairs at each overlap.
    task, skills = spans["task"], spans["task"].skills
    rng = random.Random(st.seed + 555)
    for k in range(st.s.span_width + 1):
        ex = task.sample_with_overlap(st.s.n_span_test, k, st.s.span_width, rng)
        decoder = st.composed(spans["base"], spans["experts"], ["e1", "e2"], st.span_tok)
        record("spans", f"overlap {k}", decoder, [x.render(skills, []) + " " for x in ex], x=k)
    st.tick("diagnostics", t0)


def run_seed(settings: Settings, seed: int) -> dict:
    torch.manual_seed(seed)
    st = Study(settings, seed)
    test = random_strings(settings.n_test, settings.train_length, random.Random(10_000 + seed))
    scratch = part_authors_and_failures(st, test)
    shared = part_shared(st, scratch["base"], test)
    generative = part_generative(st, test)
    part_length(st, scratch, shared, generative)
    spans = part_spans(st)
    part_diagnostics(st, scratch, shared, generative, spans, test)
    return {"seed": seed, "timings": st.timings, "records": st.records}


# ============================================================================================
# Summaries and figures (figures read summary.json only)


def summarise(runs: list[dict]) -> list[dict]:
    groups: dict[tuple, dict] = defaultdict(lambda: {"values": [], "groups": [], "kind": None})
    for run in runs:
        for r in run["records"]:
            key = (r["part"], r["pair"], r["method"], r["metric"], r["x"])
            g = groups[key]
            g["values"] += r["values"]
            g["groups"] += [r["seed"]] * len(r["values"])
            g["kind"] = r["kind"]
    rows = []
    for (part, pair, method, metric, x), g in groups.items():
        seeds = sorted(set(g["groups"]))
        mean, lo, hi = seed_bootstrap_ci(
            g["values"], groups=g["groups"] if len(seeds) > 1 else None
        )
        per_seed = [
            float(np.mean([v for v, s in zip(g["values"], g["groups"]) if s == k])) for k in seeds
        ]
        rows.append(
            {
                "part": part, "pair": pair, "method": method, "kind": g["kind"], "metric": metric,
                "x": x, "mean": mean, "ci_low": lo, "ci_high": hi, "n": len(g["values"]),
                "seeds": seeds, "per_seed": per_seed,
            }
        )  # fmt: skip
    return rows


def write_summary(out_dir: Path, rows: list[dict]) -> None:
    with atomic_output_file(out_dir / "summary.json") as tmp:
        tmp.write_text(json.dumps(rows, indent=1, ensure_ascii=False))
    with atomic_output_file(out_dir / "summary.csv") as tmp:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            for r in rows:
                w.writerow(
                    {
                        **r,
                        "seeds": " ".join(map(str, r["seeds"])),
                        "per_seed": " ".join(f"{v:.4f}" for v in r["per_seed"]),
                    }
                )


def print_main_table(rows: list[dict]) -> None:
    def pick(part, metric="joint"):
        return [r for r in rows if r["part"] == part and r["metric"] == metric and r["x"] is None]

    print("\nJoint exact match at the trained length (mean [95% CI] over seeds × test strings)")
    for part in (
        "authors",
        "generative",
        "generative-shared",
        "shared-full",
        "shared-lora",
        "failure",
        "failure-shared-full",
    ):
        sel = pick(part)
        if not sel:
            continue
        print(f"\n== {part}")
        for r in sel:
            print(
                f"  {r['pair']:<14} {r['method']:<40} {100 * r['mean']:6.1f}  [{100 * r['ci_low']:5.1f}, {100 * r['ci_high']:5.1f}]"
            )
        for r in pick(part, "chain"):
            print(
                f"  {r['pair']:<14} {r['method']:<40} {100 * r['mean']:6.1f}  (chain target A->C)"
            )


LENGTH_TITLES = {
    "length-authors": "authors' protocol (aligned, from scratch)",
    "length-shared-full": "aligned, experts = full fine-tunes of base",
    "length-generative": "generative (trained at exactly length 16)",
}
PANEL_TITLES = {
    "authors": "authors' protocol: aligned, all from scratch",
    "generative": "generative (x SEP y EOS), all from scratch",
    "shared-full": "aligned, experts = full fine-tunes of base",
    "shared-lora": "aligned, experts = LoRA fine-tunes of base",
    "generative-shared": "generative, experts = fine-tunes of base",
}


def plot_all(rows: list[dict], fig_prefix: Path, setting: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        path = Path(f"{fig_prefix}{name}.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output_file(path) as tmp:
            fig.savefig(tmp, dpi=130, bbox_inches="tight", format="png")
        plt.close(fig)
        written.append(path)

    def err(sel):
        m = np.array([100 * r["mean"] for r in sel])
        return m, np.vstack(
            [m - [100 * r["ci_low"] for r in sel], [100 * r["ci_high"] for r in sel] - m]
        )

    colors = {"base": "0.6", "expert": "tab:blue", "composition": "tab:red", "merge": "tab:green"}
    # One colour per row name across every curve figure, so a method looks the same everywhere.
    palette = plt.get_cmap("tab20")
    curve_methods = sorted(
        {r["method"] for r in rows if r["x"] is not None and r["kind"] != "diagnostic"}
    )
    method_color = {m: palette(i % 20) for i, m in enumerate(curve_methods)}
    n_seeds = max((len(r["seeds"]) for r in rows), default=0)

    # 1. Main bars: joint exact match for every row, one panel per protocol.
    panels = [
        p
        for p in ("authors", "generative", "shared-full", "shared-lora", "generative-shared")
        if any(r["part"] == p for r in rows)
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 5.2), squeeze=False)
    for ax, part in zip(axes[0], panels):
        sel = [r for r in rows if r["part"] == part and r["metric"] == "joint" and r["x"] is None]
        sel.sort(
            key=lambda r: (r["pair"], ["base", "expert", "composition", "merge"].index(r["kind"]))
        )
        labels = [f"{r['method']}" + (f"\n[{r['pair']}]" if part == "authors" else "") for r in sel]
        m, e = err(sel)
        ax.barh(range(len(sel)), m, xerr=e, color=[colors[r["kind"]] for r in sel], capsize=2)
        ax.set_yticks(range(len(sel)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 105)
        ax.set_xlabel("joint exact match (%)")
        ax.set_title(PANEL_TITLES[part], fontsize=9)
        ax.axvline(100, color="k", lw=0.5, ls=":")
    fig.suptitle(
        f"Letter replacement, joint exact match at the trained length 16 ({setting}, {n_seeds} seeds, 95% bootstrap CI)"
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="lower center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    save(fig, "letters")

    # 2. Length generalisation curves.
    parts = [
        p
        for p in ("length-authors", "length-shared-full", "length-generative")
        if any(r["part"] == p for r in rows)
    ]
    if parts:
        fig, axes = plt.subplots(
            1, len(parts), figsize=(5 * len(parts), 4), squeeze=False, sharey=True
        )
        for ax, part in zip(axes[0], parts):
            methods = sorted({r["method"] for r in rows if r["part"] == part})
            for i, method in enumerate(methods):
                sel = sorted(
                    (
                        r
                        for r in rows
                        if r["part"] == part and r["method"] == method and r["metric"] == "joint"
                    ),
                    key=lambda r: r["x"],
                )
                xs = [r["x"] for r in sel]
                # Distinct line styles keep coinciding curves (often all at 100%) visible.
                style = {"ls": ["-", "--", ":", "-."][i % 4], "marker": "osD^v"[i % 5], "ms": 3}
                line = ax.plot(
                    xs,
                    [100 * r["mean"] for r in sel],
                    label=method,
                    color=method_color[method],
                    **style,
                )[0]
                ax.fill_between(
                    xs,
                    [100 * r["ci_low"] for r in sel],
                    [100 * r["ci_high"] for r in sel],
                    color=line.get_color(),
                    alpha=0.15,
                )
            ax.axvline(16, color="k", ls=":", lw=0.8)
            ax.text(16.5, 3, "trained length", fontsize=7)
            ax.set_xlabel("input length (characters)")
            ax.set_title(LENGTH_TITLES[part], fontsize=9)
            ax.legend(fontsize=7)
        axes[0][0].set_ylabel("joint exact match (%)")
        fig.suptitle(f"Length generalisation, A→B + C→D ({setting}, 95% CI bands)")
        fig.tight_layout()
        save(fig, "length")

    # 3. Spans: success vs overlap.
    sp = [r for r in rows if r["part"] == "spans" and r["method"] != "diagnostics"]
    if sp:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, metric in zip(axes, ("joint", "outside overlap")):
            # Outside the overlap only rows that claim both skills are of interest.
            kinds = ("composition", "merge") if metric == "outside overlap" else colors
            for method in sorted({r["method"] for r in sp if r["kind"] in kinds}):
                sel = sorted(
                    (r for r in sp if r["method"] == method and r["metric"] == metric),
                    key=lambda r: r["x"],
                )
                xs = [r["x"] for r in sel]
                m, e = err(sel)
                ax.errorbar(
                    xs,
                    m,
                    yerr=e,
                    marker="o",
                    ms=4,
                    capsize=3,
                    label=method,
                    color=method_color[method],
                )
            ax.set_xlabel("letters inside both spans (overlap)")
            ax.set_xticks(range(max(r["x"] for r in sp) + 1))
            ax.set_title(
                {
                    "joint": "joint exact match (both skills, incl. overlap)",
                    "outside overlap": "correct outside the overlap",
                }[metric],
                fontsize=10,
            )
        axes[0].set_ylabel("success (%)")
        axes[0].legend(fontsize=7, title="row", title_fontsize=7)
        fig.suptitle(f"Span skills: shift inside <…>, mirror inside (…) ({setting}, 95% CI)")
        fig.tight_layout()
        save(fig, "spans")

    # 4. Failure cases: what each method writes on a doubly-claimed letter; chain vs parallel.
    def pick(part, pair, metric, method):
        sel = [
            r
            for r in rows
            if r["part"] == part
            and r["pair"] == pair
            and r["metric"] == metric
            and r["method"] == method
            and r["x"] is None
        ]
        return sel[0] if sel else None

    fig, axes = plt.subplots(1, 3, figsize=(17, 6))
    # (a) conflict A->B with A->C: stacked fractions of the A positions.
    ax = axes[0]
    bars = []
    for part in ("failure", "failure-shared-full"):
        methods = [
            r["method"]
            for r in rows
            if r["part"] == part and r["pair"] == "A->B + A->C" and r["metric"] == "A kept"
        ]
        bars += [
            (part, m)
            for m in methods
            if m in ("base", "composition") or part == "failure-shared-full"
        ]
    outcome_colors = {"A written as B": "tab:blue", "A written as C": "tab:orange", "A kept": "0.6"}
    for i, (part, method) in enumerate(bars):
        left = 0.0
        for metric, color in outcome_colors.items():
            r = pick(part, "A->B + A->C", metric, method)
            v = 100 * r["mean"] if r else 0.0
            ax.barh(i, v, left=left, color=color, label=metric if i == 0 else None)
            left += v
        ax.barh(
            i,
            100 - left,
            left=left,
            color="tab:red",
            alpha=0.5,
            label="other letter" if i == 0 else None,
        )
    ax.set_yticks(
        range(len(bars)),
        [f"{m} ({'scratch' if p == 'failure' else 'fine-tuned'})" for p, m in bars],
        fontsize=7,
    )
    ax.invert_yaxis()
    ax.set_xlabel("% of input A positions")
    ax.set_title("(a) conflict: A→B with A→C — what is written for A", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    # (b) chain A->B with B->C: parallel target (each letter once) vs chain target (A→C).
    ax = axes[1]
    bars = []
    for part in ("failure", "failure-shared-full"):
        methods = [
            r["method"]
            for r in rows
            if r["part"] == part and r["pair"] == "A->B + B->C" and r["metric"] == "chain"
        ]
        bars += [(part, m) for m in methods if m != "base"]
    for j, (metric, color, label) in enumerate(
        (
            ("joint", "tab:purple", "parallel target (A→B, B→C)"),
            ("chain", "tab:olive", "chain target (A→C, B→C)"),
        )
    ):
        sel = [pick(p, "A->B + B->C", metric, m) for p, m in bars]
        m, e = err(sel)
        ax.barh(
            np.arange(len(sel)) + 0.4 * j - 0.2,
            m,
            height=0.4,
            xerr=e,
            color=color,
            capsize=2,
            label=label,
        )
    ax.set_yticks(
        range(len(bars)),
        [f"{m} ({'scratch' if p == 'failure' else 'fine-tuned'})" for p, m in bars],
        fontsize=7,
    )
    ax.invert_yaxis()
    ax.set_xlim(0, 105)
    ax.set_xlabel("joint exact match (%)")
    ax.set_title("(b) chain: A→B with B→C", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    # (c) wrong base under the A->B, C->D experts (from scratch).
    ax = axes[2]
    sel = [
        r
        for r in rows
        if r["part"] in ("authors", "failure")
        and r["pair"] == "A->B + C->D"
        and r["metric"] in ("joint", "skill A->B", "skill C->D")
        and r["method"].startswith("composition")
    ]
    sel.sort(key=lambda r: (r["method"], r["metric"]))
    m, e = err(sel)
    ax.barh(
        range(len(sel)),
        m,
        xerr=e,
        color=["tab:red" if r["metric"] == "joint" else "tab:pink" for r in sel],
        capsize=2,
    )
    ax.set_yticks(range(len(sel)), [f"{r['method']} · {r['metric']}" for r in sel], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 105)
    ax.set_xlabel("success (%)")
    ax.set_title("(c) wrong base: A→B + C→D experts over another base", fontsize=9)
    fig.suptitle(f"Failure cases the theory predicts ({setting}, {n_seeds} seeds, 95% CI)")
    fig.tight_layout()
    save(fig, "failures")

    # 5. Diagnostics vs success: two per-token measures against composition joint success.
    def success_of(r):
        if r["part"] == "spans":
            sel = [
                s
                for s in rows
                if s["part"] == "spans"
                and s["method"] == "composition"
                and s["metric"] == "joint"
                and s["x"] == r["x"]
            ]
        else:
            pair, _, wb = r["pair"].partition(" (")
            name = f"composition ({wb[:-1]})" if wb else "composition"
            sel = [
                s
                for s in rows
                if s["part"] == r["part"]
                and s["pair"] == pair
                and s["method"] == name
                and s["metric"] == "joint"
                and s["x"] is None
            ]
        return sel[0] if sel else None

    measures = {
        "co-active@0.1": "co-active positions: both experts have KL(p_i‖p_b) > 0.1 nats (%)",
        "composed top-1 differs": "positions where the composed top-1 differs from every model's (%)",
    }
    cases = [
        r
        for r in rows
        if r["method"] == "diagnostics" and r["metric"] == "co-active@0.1" and success_of(r)
    ]
    if cases:
        fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), sharey=True)
        cmap = plt.get_cmap("tab20")
        for ax, (metric, xlabel) in zip(axes, measures.items()):
            for i, case in enumerate(cases, 1):
                r = next(
                    d
                    for d in rows
                    if d["method"] == "diagnostics"
                    and d["metric"] == metric
                    and d["part"] == case["part"]
                    and d["pair"] == case["pair"]
                    and d["x"] == case["x"]
                )
                s = success_of(case)
                xerr = [[100 * (r["mean"] - r["ci_low"])], [100 * (r["ci_high"] - r["mean"])]]
                yerr = [[100 * (s["mean"] - s["ci_low"])], [100 * (s["ci_high"] - s["mean"])]]
                ax.errorbar(
                    100 * r["mean"],
                    100 * s["mean"],
                    xerr=xerr,
                    yerr=yerr,
                    marker="o",
                    capsize=2,
                    color=cmap((i - 1) % 20),
                    label=f"{i}: {case['part']} · {case['pair']}",
                )
                ax.annotate(
                    str(i),
                    (100 * r["mean"], 100 * s["mean"]),
                    fontsize=7,
                    xytext=(4, 4 + 6 * (i % 3)),
                    textcoords="offset points",
                )
            ax.set_xlabel(xlabel, fontsize=9)
        axes[0].set_ylabel("composition joint exact match (%)")
        axes[1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.suptitle(
            f"Do per-token diagnostics predict composition success? ({setting}, 95% CI over seeds)"
        )
        fig.tight_layout()
        save(fig, "diagnostics")
    return written


# ============================================================================================


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--full", action="store_true", help="authors' settings (batch 1), 5 seeds, lengths 1..64"
    )
    p.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
    p.add_argument("--plot-only", action="store_true", help="redraw figures from the summary file")
    p.add_argument("--force", action="store_true", help="recompute seeds that already have results")
    p.add_argument("--results", type=Path, default=ROOT / "results" / "toy")
    p.add_argument("--figures", type=Path, default=ROOT / "figures")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: tiny models gain nothing from more)",
    )
    args = p.parse_args(argv)

    settings = full_settings() if args.full else Settings()
    if args.seeds:
        settings.seeds = args.seeds
    out_dir = args.results / settings.name
    fig_prefix = args.figures / ("toy_" if settings.name == "fast" else f"toy_{settings.name}_")

    if not args.plot_only:
        torch.set_num_threads(args.threads)
        out_dir.mkdir(parents=True, exist_ok=True)
        config = {"settings": settings.to_dict(), "merges": [g[:3] for g in merge_grid(settings.lambdas)],
                  "torch": torch.__version__, "threads": args.threads}  # fmt: skip
        with atomic_output_file(out_dir / "config.json") as tmp:
            tmp.write_text(json.dumps(config, indent=1, ensure_ascii=False))
        t_start = time.perf_counter()
        for seed in tqdm(settings.seeds, desc=f"toy ({settings.name}) seeds"):
            path = out_dir / f"seed_{seed}.json"
            if path.exists() and not args.force:
                done = json.loads(path.read_text())
                if done.get("settings") == settings.to_dict():
                    tqdm.write(f"seed {seed}: reusing {path}")
                    continue
            t0 = time.perf_counter()
            result = run_seed(settings, seed)
            result["settings"] = settings.to_dict()
            result["seconds"] = round(time.perf_counter() - t0, 1)
            with atomic_output_file(path) as tmp:
                tmp.write_text(json.dumps(result, ensure_ascii=False))
            tqdm.write(f"seed {seed}: {result['seconds']} s  {result['timings']}")
        print(f"total {time.perf_counter() - t_start:.0f} s")
        runs = [json.loads((out_dir / f"seed_{s}.json").read_text()) for s in settings.seeds]
        write_summary(out_dir, summarise(runs))

    summary_path = out_dir / "summary.json"
    if not summary_path.exists():
        print(f"no results at {summary_path}; run without --plot-only first", file=sys.stderr)
        return 1
    rows = json.loads(summary_path.read_text())
    print_main_table(rows)
    for path in plot_all(rows, fig_prefix, settings.name):
        print(f"figure: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
