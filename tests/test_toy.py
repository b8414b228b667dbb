"""Toy letter-replacement and span-skill tasks: the must-show properties on a fixed seed.

Tiny settings (short strings, few updates) so the whole file runs in well under two minutes on
two CPU cores; ``studies/toy_letters.py`` runs the same things at the study's settings.
"""

from __future__ import annotations

import random

import pytest

from mergelab.compose import ComposedDecoder, ModelCandidate
from mergelab.toy import (
    AlignedTask,
    GenerativeTask,
    LetterMap,
    TrainConfig,
    build_char_tokenizer,
    exact_match,
    parallel_target,
    random_strings,
    seed_bootstrap_ci,
    skill_success,
    tiny_gpt2,
    train_model,
)
from mergelab.toy.evaluate import aligned_predictions, generative_predictions
from mergelab.toy.tasks import SPAN_MARKERS, SpanExample, SpanSkillTask
from mergelab.toy.train import finetune_full

AB, CD = LetterMap.parse("A->B"), LetterMap.parse("C->D")


# ---------------------------------------------------------------- pure parts (fast)


def test_tokenizer_one_token_per_character_and_exact_decode():
    tok = build_char_tokenizer()
    assert len(tok) == 3 + 27  # pad/eos/sep + space + A–Z
    text = "AB CD  Z"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(ids) == list(text)
    span_tok = build_char_tokenizer(SPAN_MARKERS)
    assert len(span_tok) == 34
    with pytest.raises(ValueError, match="not in the toy alphabet"):
        AlignedTask(tok).encode(["ab"], ["ab"])
    with pytest.raises(ValueError, match="other than"):
        build_char_tokenizer("[")


def test_letter_maps_parallel_and_chain_targets():
    assert AB("ABBA C") == "BBBB C"
    assert parallel_target([AB, CD], "ACE") == "BDE"
    # A chain differs: composition rewrites each input letter once (parallel), a chain twice.
    bc = LetterMap.parse("B->C")
    assert parallel_target([AB, bc], "AB") == "BC"
    assert LetterMap.chain([AB, bc], "AB") == "CC"
    # Two maps rewriting the same letter differently: the joint target is undefined.
    assert parallel_target([AB, LetterMap.parse("A->C")], "XA") is None
    with pytest.raises(ValueError, match="bad letter map"):
        LetterMap.parse("A=>B")


def test_aligned_encoding_has_no_shift_and_generative_masks_the_prompt():
    tok = build_char_tokenizer()
    ids, labels = AlignedTask(tok).encode(["AC"], ["BD"])
    assert ids.tolist() == [[tok.convert_tokens_to_ids("A"), tok.convert_tokens_to_ids("C")]]
    assert labels.tolist() == [[tok.convert_tokens_to_ids("B"), tok.convert_tokens_to_ids("D")]]
    ids, labels = GenerativeTask(tok).encode(["AC"], ["BD"])
    b, d = tok.convert_tokens_to_ids(["B", "D"])
    # x0 x1 SEP y0 y1 EOS: logits at SEP predict y0, at y1 predict EOS, nothing else.
    assert labels.tolist() == [[-100, -100, b, d, tok.eos_token_id, -100]]


def test_span_rendering_places_markers_and_applies_skills_inside_only():
    task = SpanSkillTask(n_letters=6)
    shift, mirror = task.skills
    ex = SpanExample("ABCDEF", ((0, 2), (3, 5)))
    assert ex.render(task.skills, []) == "<AB>C(DE)F"
    assert ex.render(task.skills, [shift]) == "<BC>C(DE)F"
    assert ex.render(task.skills, [shift, mirror]) == "<BC>C(WV)F"
    assert ex.overlap() == 0
    for k in range(4):
        for e in task.sample_with_overlap(20, k, 3, random.Random(k)):
            assert e.overlap() == k


def test_metrics_and_two_level_bootstrap():
    assert exact_match(["AB", "CD"], ["AB", None]).tolist() == [1.0, 0.0]
    s = skill_success(["AXA", "XXX", "AA"], ["BXB", "XXX", "BA"], AB)
    assert s.tolist() == [1.0, 0.0]  # the example without an A is not scored
    mean, lo, hi = seed_bootstrap_ci([1.0] * 50 + [0.0] * 50, groups=[0] * 50 + [1] * 50)
    assert mean == 0.5 and lo <= 0.05 and hi >= 0.95  # the seeds disagree completely
    mean, lo, hi = seed_bootstrap_ci([1.0] * 40)
    assert (mean, lo, hi) == (1.0, 1.0, 1.0)


# ---------------------------------------------------------------- trained models (must-show)


def _train(task, fn, xs, cfg, vocab, seed):
    model = tiny_gpt2(vocab, n_positions=64, seed=seed)
    train_model(model, *task.encode(xs, [fn(x) for x in xs]), cfg)
    return model


def test_aligned_protocol_composition_reaches_100_percent():
    """Authors' protocol: identity base and A→B, C→D experts, each trained from scratch."""
    tok = build_char_tokenizer()
    task = AlignedTask(tok)
    rng = random.Random(0)
    cfg = TrainConfig(epochs=3, batch_size=16, lr=1e-3, seed=0)
    base, ab, cd = (
        _train(task, m, random_strings(800, 10, rng), cfg, len(tok), seed)
        for seed, m in enumerate([LetterMap(), AB, CD])
    )
    test = random_strings(300, 10, random.Random(99))
    joint = [parallel_target([AB, CD], x) for x in test]
    composed = ComposedDecoder(base, [ab, cd], tok, expert_names=["A->B", "C->D"])
    preds = aligned_predictions(composed, task, test)
    assert exact_match(preds, joint).mean() == 1.0
    assert skill_success(test, preds, AB).mean() == 1.0
    assert skill_success(test, preds, CD).mean() == 1.0
    # Each expert alone misses the other's letter: the test can fail.
    alone = aligned_predictions(ModelCandidate(ab, tok, name="A->B"), task, test)
    assert exact_match(alone, joint).mean() < 0.8


def test_generative_protocol_shared_init_composition_reaches_100_percent():
    """x [SEP] y [EOS], greedy until EOS; experts fine-tuned from the copy base."""
    tok = build_char_tokenizer()
    task = GenerativeTask(tok)
    rng = random.Random(1)
    length = 6
    base = _train(
        task,
        LetterMap(),
        random_strings(1200, length, rng),
        TrainConfig(epochs=4, batch_size=16, lr=2e-3, seed=0),
        len(tok),
        seed=0,
    )
    ft = TrainConfig(epochs=2, batch_size=16, lr=1e-3, seed=1)
    experts = []
    for m in (AB, CD):
        xs = random_strings(600, length, rng)
        experts.append(finetune_full(base, *task.encode(xs, [m(x) for x in xs]), ft)[0])
    test = random_strings(150, length, random.Random(98))
    joint = [parallel_target([AB, CD], x) for x in test]
    composed = ComposedDecoder(base, experts, tok, expert_names=["A->B", "C->D"])
    preds = generative_predictions(composed, task, test)
    assert exact_match(preds, joint).mean() == 1.0
    alone = generative_predictions(ModelCandidate(experts[0], tok, name="A->B"), task, test)
    assert exact_match(alone, joint).mean() < 0.9


@pytest.fixture(scope="module")
def span_models():
    """Copy base over marked strings, then a shift<> and a mirror() expert fine-tuned from it."""
    tok = build_char_tokenizer(SPAN_MARKERS)
    task = SpanSkillTask(n_letters=8, max_span=4)
    enc = AlignedTask(tok)
    rng = random.Random(2)

    def data(active, n):
        ex = task.sample_random(n, rng)
        return enc.encode(
            [e.render(task.skills, []) for e in ex], [e.render(task.skills, active) for e in ex]
        )

    base = tiny_gpt2(len(tok), n_positions=64, seed=0)
    train_model(base, *data([], 2000), TrainConfig(epochs=5, batch_size=16, lr=2e-3, seed=0))
    experts = [
        finetune_full(base, *data([sk], 1500), TrainConfig(epochs=4, batch_size=16, lr=1e-3))[0]
        for sk in task.skills
    ]
    composed = ComposedDecoder(base, experts, tok, expert_names=[s.name for s in task.skills])
    return task, enc, composed


def _span_success(task, enc, composed, overlap):
    ex = task.sample_with_overlap(120, overlap, 3, random.Random(10 + overlap))
    preds = aligned_predictions(composed, enc, [e.render(task.skills, []) for e in ex])
    return exact_match(preds, [e.render(task.skills, task.skills) for e in ex]).mean()


def test_disjoint_spans_compose(span_models):
    """Joint factorizability: each skill applied exactly in its own span, copy elsewhere."""
    assert _span_success(*span_models, overlap=0) == 1.0


def test_overlapping_spans_fail_as_predicted(span_models):
    """Inside the overlap both experts move away from the base to different letters."""
    rates = [_span_success(*span_models, overlap=k) for k in (1, 2)]
    assert max(rates) < 0.5, rates
