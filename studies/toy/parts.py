"""The parts of the toy study; each seed runs all of them, in this order.

1. authors     aligned protocol, every model from scratch: base = identity, experts A→B, C→D
               and the authors' code's A→K, M→B. Base, experts, composition.
6. failure     (trained with part 1) two experts on the same letter (A→B with A→C), a chain
               (A→B with B→C), a wrong base (untrained; trained on a shuffled alphabet).
3. shared      experts fine-tuned from the base (full and LoRA) so that task arithmetic (λ grid),
               TIES, DARE, linear averaging and SLERP are meaningful next to the composition.
2. generative  ``x [SEP] y [EOS]``, greedy decoding until EOS; experts from scratch, and experts
               fine-tuned from the generative base (then the weight merges are rows too).
4. length      trained at length 16, tested at lengths 1..64 (parts 1–3).
5. spans, 7. diagnostics: :mod:`.spans`.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

from tqdm import tqdm

from mergelab.toy import LetterMap, random_strings

from .study import Study
from .train import finetune_full, tiny_gpt2


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
        )
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
