"""The parts of the toy study; each seed runs all of them, in this order.

1. authors     aligned protocol, every model from scratch: base = identity, experts A→B, C→D
               and the authors' code's A→K, M→B. Base, experts, composition.
6. failure     (trained with part 1) two experts on the same letter (A→B with A→C), a chain
               (A→B with B→C), a wrong base (untrained; trained on a shuffled alphabet).
3. shared      experts fine-tuned from the base (full and LoRA) so that task arithmetic (λ grid),
               TIES, DARE, linear averaging and SLERP are meaningful next to the composition.
2. generative  ``x [SEP] y [EOS]``, greedy decoding until EOS; experts from scratch, and experts
               fine-tuned from the generative base (then the weight merges are rows too, and
               task arithmetic with λ chosen on validation strings). Evaluated by
               ``mergelab.compare`` (:func:`.evaluate.compare_letters`).
4. length      trained at length 16, tested at lengths 1..64 (parts 1–3; the generative rows
               by ``mergelab.compare``).
5. spans, 7. diagnostics: :mod:`.spans`.
"""

from __future__ import annotations

import random
import time

from tqdm import tqdm

from mergelab.toy import LetterMap, random_strings

from .study import Study, merge_grid
from .train import tiny_gpt2


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
    """Part 2: generative protocol, greedy decoding until EOS, every row through mergelab.compare.

    Experts from scratch (as in the authors' protocol) and experts fine-tuned from the
    generative base (shared initialisation, so the weight merges are rows too). Every merge of
    the grid is a row on the test strings; one more row is task arithmetic with λ chosen by
    compare on validation strings (drawn apart from the test strings): the λ of the grid with the
    highest joint exact match, the smallest on ties.
    """
    t0 = time.perf_counter()
    maps = [LetterMap.parse("A->B"), LetterMap.parse("C->D")]
    names = [m.name for m in maps]
    base = st.scratch(LetterMap(), generative=True)
    scratch = [st.scratch(m, generative=True) for m in maps]
    tuned = [st.finetuned(base, m, generative=True) for m in maps]
    st.tick("train generative", t0)
    t0 = time.perf_counter()
    rows = [("base", "base", "base")] + [("expert", f"expert {n}", n) for n in names]
    rows += [("composition", "composition", "composition")]
    families = [
        {"family": "base"},
        {"family": "expert", "experts": names, "best_expert": False},  # rows, no choice
        {"family": "composition", "experts": names},
    ]
    if st.wants("generative"):
        models = {"base": base} | dict(zip(names, scratch))
        st.compare_letters("generative", maps, models, families, rows, test)
    if st.wants("generative-shared"):
        grid = merge_grid(st.s.lambdas)
        # Linear average and SLERP merge the two experts alone (use_base: false).
        models = {"base": base} | dict(zip(names, tuned))
        merge_families = [
            {
                "family": "merge",
                "name": label,
                "method": method,
                "experts": names,
                "params": {("lambda" if k == "lambda_" else k): v for k, v in params.items()},
                "use_base": use_base,
            }
            for label, method, params, use_base in grid
        ]
        chosen = "TA (λ chosen on validation)"
        tuned_ta = {
            "family": "merge",
            "name": chosen,
            "method": "task_arithmetic",
            "experts": names,
            "grid": {"lambda": list(st.s.lambdas)},
        }
        labels = [g[0] for g in grid]  # the rows in the grid's order, as in the aligned parts
        choices = st.compare_letters(
            "generative-shared",
            maps,
            models,
            families + merge_families + [tuned_ta],
            rows + [("merge", label, label) for label in labels] + [("merge", chosen, chosen)],
            test,
            validation=random_strings(
                st.s.n_validation, st.s.train_length, random.Random(20_000 + st.seed)
            ),
        )
        st.choices["generative-shared"] = choices["families"]
    st.tick("eval generative", t0)
    return {"maps": maps, "names": names, "base": base, "scratch": scratch, "tuned": tuned}


def length_generative_rows(st: Study, generative: dict) -> tuple[dict, list[dict], list[tuple]]:
    """The length sweep's generative rows: compare's models and families, the recorded rows."""
    names, base = generative["names"], generative["base"]
    scratch = [f"{n} (scratch)" for n in names]
    models = {"base": base} | dict(zip(scratch, generative["scratch"]))
    models |= dict(zip(names, generative["tuned"]))
    rows = [
        ("base", "base", "base"),
        ("composition", "composition (scratch experts)", "composition (scratch experts)"),
        ("composition", "composition (fine-tuned experts)", "composition (fine-tuned experts)"),
    ]
    families = [
        {"family": "base"},
        {"family": "composition", "name": rows[1][1], "experts": scratch},
        {"family": "composition", "name": rows[2][1], "experts": names},
    ]
    if 1.0 in st.s.lambdas:
        rows.append(("merge", "TA λ=1 (fine-tuned)", "TA λ=1 (fine-tuned)"))
        families.append(
            {
                "family": "merge",
                "name": rows[3][1],
                "method": "task_arithmetic",
                "experts": names,
                "params": {"lambda": 1.0},
            }
        )
    return models, families, rows


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
    gen_rows = length_generative_rows(st, generative)
    rng = random.Random(st.seed + 777)
    for length in tqdm(st.s.lengths, desc="  lengths", leave=False):
        inputs = random_strings(st.s.n_test_per_length, length, rng)
        for part, rows in plans.items():
            st.eval_letters(part, ab_cd, rows, inputs, x=length)
        if st.wants("length-generative"):
            st.compare_letters("length-generative", generative["maps"], *gen_rows, inputs, x=length)
    st.tick("length sweep", t0)
