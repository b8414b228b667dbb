"""Part 5 (span skills with stopping times) and part 7 (per-token diagnostics) of the toy study.

5. spans       shift letters inside <…>, mirror them inside (…); base copies. Success as the
               two spans' overlap grows.
7. diagnostics per-token expert activity (KL to the base) and co-activity vs composition success.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

from mergelab.toy import AlignedTask, SpanSkillTask, parallel_target

from .evaluate import aligned_predictions, exact_match
from .study import Study
from .train import finetune_full, tiny_gpt2, train_model


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
        finetune_full(base, *data([sk]), replace(st.s.spans_finetune, seed=st.next_seed()))
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
    for k in range(st.s.span_width + 1 if st.wants("spans") else 0):
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
