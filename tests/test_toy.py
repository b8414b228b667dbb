"""The toy study (``studies/toy/``) and its tasks (``mergelab.toy``): must-show properties on a
fixed seed, and the study's own pieces checked against the library or hand-computed values.

Tiny settings (short strings, few updates) so the file runs in about two minutes on two CPU
cores; ``studies/toy_letters.py`` runs the same things at the study's settings.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mergelab import ModelCandidate
from mergelab.compose import ComposedDecoder, Composition, compose_logprobs
from mergelab.merge import merge_models
from mergelab.toy import (
    ALPHABET,
    AlignedTask,
    GenerativeTask,
    LetterMap,
    SpanExample,
    SpanSkillTask,
    build_char_tokenizer,
    parallel_target,
    random_strings,
)
from mergelab.toy.tasks import SPAN_MARKERS
from studies.toy import authors_exact, many_experts
from studies.toy.evaluate import (
    aligned_predictions,
    compare_letters,
    exact_match,
    letter_benchmarks,
    row_scores,
    skill_success,
)
from studies.toy.explanations import answer_logprobs
from studies.toy.summary import seed_t_interval, summarise
from studies.toy.train import TrainConfig, finetune_full, tiny_gpt2, train_model

ROOT = Path(__file__).resolve().parents[1]
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
    # The swap variant of the explanations: each source letter is also a target.
    assert (
        parallel_target([LetterMap.parse("A->B,B->A"), LetterMap.parse("C->D,D->C")], "ABCDE")
        == "BADCE"
    )
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


def test_metrics():
    assert exact_match(["AB", "CD"], ["AB", None]).tolist() == [1.0, 0.0]
    s = skill_success(["AXA", "XXX", "AA"], ["BXB", "XXX", "BA"], AB)
    assert s.tolist() == [1.0, 0.0]  # the example without an A is not scored


def test_letter_tasks_score_as_the_study_did():
    """letter_map: exact match after a clean EOS; letter_skill: the touched positions only."""
    from mergelab.eval.letter_tasks import letter_correct, skill_answer, skill_correct

    assert letter_correct("BXD", "BXD", "eos", n_tokens=3)
    # A special token ([SEP], [PAD]) is dropped from the decoded text: 4 tokens, 3 characters.
    assert not letter_correct("BXD", "BXD", "eos", n_tokens=4)
    assert not letter_correct("BXD", "BXD", "length", n_tokens=3)  # no EOS within the budget
    answer = skill_answer("AXCA", AB, AB.touches)
    assert answer == "B??B"
    assert skill_correct("BXDB", answer, "eos", 4)
    assert skill_correct("BQQB", answer, "eos", 4)  # other positions are not this skill's
    assert not skill_correct("BXDA", answer, "eos", 4)
    assert not skill_correct("BXDBB", answer, "eos", 5)  # a different length
    assert not skill_correct("BXDB", answer, "length", 4)
    assert not skill_correct("BXDB", answer, "eos", 5)
    # The study's skill metric on the same strings agrees.
    preds = ["BXDB", "BQQB", "BXDA", "BXDBB"]
    assert skill_success(["AXCA"] * 4, preds, AB).tolist() == [
        float(skill_correct(p, answer, "eos", len(p))) for p in preds
    ]


def test_letter_benchmarks_keep_the_input_order_and_refuse_what_they_cannot_score():
    xs = ["AXC", "QQQ", "CCA"]
    benches = {b["name"]: b for b in letter_benchmarks([AB, CD], xs, validation=["ZZA"])}
    assert list(benches) == ["joint", "skill A->B", "skill C->D"]
    joint = benches["joint"]
    assert [it.answer for it in joint["benchmark"].items] == ["BXD", "QQQ", "DDB", "ZZB"]
    assert joint["split"] == {"test": ["0", "1", "2"], "validation": ["v0"]}
    skill = benches["skill A->B"]["benchmark"]
    assert [(it.item_id, it.answer) for it in skill.items] == [("0", "B??"), ("2", "??B")]
    assert joint["generation"] == {"max_new_tokens": 4, "batch_size": 64}
    with pytest.raises(ValueError, match="share a length"):
        letter_benchmarks([AB, CD], ["AB", "ABC"])
    with pytest.raises(ValueError, match="conflict or chain"):
        letter_benchmarks([AB, LetterMap.parse("B->C")], ["AB"])


def test_a_rerun_part_replaces_its_records_in_place():
    from studies.toy.run import merge_records

    def rec(part, method, kind="base", x=None):
        return {
            "part": part,
            "pair": "p",
            "method": method,
            "kind": kind,
            "x": x,
            "metric": "joint",
            "values": [0.0],
        }

    old = [
        rec("authors", "a"),
        rec("generative", "g1"),
        rec("generative", "g2"),
        rec("generative", "d", "diagnostic"),
        rec("length-generative", "l", x=2),
    ]
    new = [
        rec("generative", "g1") | {"values": [1.0]},
        rec("generative", "g3"),
        rec("length-generative", "l", x=2) | {"values": [1.0]},
    ]
    out = merge_records(old, new, {"generative", "length-generative"})
    assert [(r["method"], r["values"]) for r in out] == [
        ("a", [0.0]),  # another part: kept
        ("g1", [1.0]),  # replaced where it was
        ("g3", [0.0]),  # new: after the record written before it
        ("d", [0.0]),  # diagnostics are their own part; g2 is no longer written
        ("l", [1.0]),
    ]


def test_a_skipped_part_draws_its_data_so_later_models_are_the_same():
    from studies.toy.study import Settings, Study

    s = Settings(n_train=8, scratch=TrainConfig(epochs=1, batch_size=8))
    runs = []
    for train in (True, False):
        st = Study(s, 0)
        st.train = train
        first = st.scratch(AB)
        st.finetuned(first, CD, lora=True)
        st.train = True
        runs.append((st.scratch(CD), st.rng.getstate(), st.next_seed()))
    (trained, rng_a, seed_a), (replayed, rng_b, seed_b) = runs
    assert rng_a == rng_b and seed_a == seed_b
    assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), replayed.parameters()))


def test_seed_t_interval_against_hand_computed_values():
    # The three seeds of the fast study's from-scratch generative composition.
    per_seed = [0.387, 0.693, 0.230]
    mean = sum(per_seed) / 3  # 0.43667
    sd = math.sqrt(sum((v - mean) ** 2 for v in per_seed) / 2)  # 0.23544
    half = 4.302652729911275 * sd / math.sqrt(3)  # t_{0.975, 2}
    low, high = seed_t_interval(per_seed)
    assert low == pytest.approx(max(0.0, mean - half), abs=1e-9)
    assert high == pytest.approx(min(1.0, mean + half), abs=1e-9)
    assert (low, high) == (0.0, 1.0)  # three seeds this far apart say almost nothing
    # Not a rate (e.g. a log-prob margin): the same interval, not clipped.
    assert seed_t_interval(per_seed, rate=False) == pytest.approx((mean - half, mean + half))
    # sd 0.02 over 3 seeds: half-width 4.3027 * 0.02 / sqrt(3) = 0.049683, no clipping.
    assert seed_t_interval([0.80, 0.82, 0.84]) == pytest.approx((0.770317, 0.869683), abs=1e-6)
    assert seed_t_interval([1.0, 1.0, 1.0]) == (1.0, 1.0)
    assert all(math.isnan(v) for v in seed_t_interval([0.7]))


def test_summary_rows_are_means_of_per_seed_means():
    def rec(seed, values):
        return {
            "part": "p",
            "pair": "A",
            "method": "m",
            "kind": "composition",
            "seed": seed,
            "x": None,
            "metric": "joint",
            "values": values,
        }

    runs = [{"records": [rec(0, [1, 1, 0, 0])]}, {"records": [rec(1, [1.0])]}]
    (row,) = summarise(runs)
    assert row["per_seed"] == [0.5, 1.0] and row["seeds"] == [0, 1]
    assert row["mean"] == 0.75 and row["n"] == 5  # not the pooled 3/5
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((0.0, 1.0))


# ---------------------------------------------------------------- the authors' notebook


def test_authors_exact_uses_the_notebooks_settings():
    xs = random_strings(3, 16, random.Random(0))
    model, log = authors_exact.train(AB, xs, seed=0)
    c = model.config
    assert (c.n_layer, c.n_head, c.n_embd, c.n_positions, c.vocab_size) == (2, 2, 64, 32, 27)
    assert c.resid_pdrop == c.embd_pdrop == c.attn_pdrop == 0.1
    assert authors_exact.optimizer(model).defaults["weight_decay"] == 0.01
    assert log["steps"] == 5 * 3  # batch 1, 5 epochs
    # Dropout is on while training and off afterwards: training is seeded, so it repeats.
    again, _ = authors_exact.train(AB, xs, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_authors_exact_composition_is_the_library_rule():
    """The notebook's argmax of log p1 + log p2 − log p_b equals mergelab's composition."""
    models = {
        k: tiny_gpt2(27, n_positions=32, seed=i) for i, k in enumerate(["base", "A->B", "C->D"])
    }
    xs = random_strings(20, 12, random.Random(1))
    preds = authors_exact.predictions(models, xs)
    with torch.no_grad():
        lp = [
            torch.log_softmax(models[k](input_ids=authors_exact.ids(xs)).logits, -1) for k in models
        ]
    composed = compose_logprobs(lp[0], lp[1:]).argmax(-1)
    assert preds["composition"] == ["".join(ALPHABET[i] for i in row) for row in composed.tolist()]
    poe = Composition.product_of_experts(["e1", "e2"]).log_probs(lp[1:]).argmax(-1)
    assert preds["product of experts (no base)"] == [
        "".join(ALPHABET[i] for i in r) for r in poe.tolist()
    ]


# ---------------------------------------------------------------- diagnostics line up with the decoder


@pytest.mark.parametrize("generative", [False, True])
def test_anatomy_scores_the_positions_the_decoder_scores(generative):
    """The many-experts anatomy's token error rate equals the ComposedDecoder's, position for position."""
    tok = build_char_tokenizer()
    task = GenerativeTask(tok) if generative else AlignedTask(tok)
    maps = [AB, CD, LetterMap.parse("E->F")]
    models = {
        n: tiny_gpt2(len(tok), seed=i, initializer_range=0.3)
        for i, n in enumerate(["base", "e1", "e2", "e3"])
    }
    xs = random_strings(12, 6, random.Random(2), alphabet="ABCDEF ")
    joint = [parallel_target(maps, x) for x in xs]
    input_ids, labels = task.encode(xs, joint)
    decoder = ComposedDecoder(models["base"], [models[n] for n in ("e1", "e2", "e3")], tok)
    with torch.no_grad():
        # Decoder position t predicts token t + 1, which is what labels[:, t] holds in both
        # encodings (aligned: y[t]; generative: the next answer token).
        chosen = decoder.token_logprobs(input_ids, torch.ones_like(input_ids)).argmax(-1)
    # Untrained models are almost always wrong: make about half the scored labels the
    # decoder's own choice, so the error rate is neither 0 nor 1 and positions must line up.
    mask = labels != -100
    coin = torch.rand(labels.shape, generator=torch.Generator().manual_seed(0)) < 0.5
    labels = torch.where(mask & coin, chosen, labels)
    expected = (chosen[mask] != labels[mask]).float().mean().item()
    assert 0.2 < expected < 0.8
    lp = answer_logprobs(models, input_ids, labels) | {"eos": generative}
    report = many_experts.anatomy(lp, ["e1", "e2", "e3"], maps, xs, tok)
    assert report["token error rate"] == pytest.approx(expected, abs=1e-6)
    shares = [report[f"error share at {w}"] for w in ("rewritten letters", "copied letters", "EOS")]
    assert sum(shares) == pytest.approx(1.0)
    assert (report["error share at EOS"] > 0) == generative or report["error share at EOS"] == 0


# ---------------------------------------------------------------- trained models (must-show)


def _greedy_strings(candidate, task, inputs):
    """The study's evaluator before compare: greedy from ``x [SEP]``, ``len(x) + 1`` new tokens,
    the generated tokens joined when the generation ended with EOS (else None)."""
    from mergelab.candidate import GenerationSettings

    settings = GenerationSettings(max_new_tokens=len(inputs[0]) + 1, batch_size=64)
    gens = candidate.generate([task.prompt(x) for x in inputs], settings)
    return [
        "".join(task.tokenizer.convert_ids_to_tokens(g.token_ids))
        if g.finish_reason == "eos"
        else None
        for g in gens
    ]


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
        experts.append(finetune_full(base, *task.encode(xs, [m(x) for x in xs]), ft))
    test = random_strings(150, length, random.Random(98))
    joint = [parallel_target([AB, CD], x) for x in test]
    # The study's path: every row through mergelab.compare (base, experts, composition, merges).
    results = compare_letters(
        {"base": base, "A->B": experts[0], "C->D": experts[1]},
        tok,
        [
            {"family": "base"},
            {"family": "expert", "best_expert": False},
            {"family": "composition"},
            {"family": "merge", "name": "TA", "method": "task_arithmetic", "params": {"lambda": 1}},
        ],
        letter_benchmarks([AB, CD], test),
        seed=0,
    )
    assert row_scores(results, "composition", "joint") == [1.0] * len(test)
    assert sum(row_scores(results, "A->B", "joint")) < 0.9 * len(test)  # the test can fail
    # compare scores each row as the study's own evaluator did (the generated strings).
    composed = ComposedDecoder(base, experts, tok, expert_names=["A->B", "C->D"])
    candidates = {
        "A->B": ModelCandidate(experts[0], tok, name="A->B"),
        "composition": composed,
        "TA": ModelCandidate(
            merge_models("task_arithmetic", base, experts, params={"lambda_": 1}), tok
        ),
    }
    for row, cand in candidates.items():
        preds = _greedy_strings(cand, task, test)
        assert row_scores(results, row, "joint") == exact_match(preds, joint).tolist()
        for m in (AB, CD):
            safe = [p if p is not None else "" for p in preds]
            assert (
                row_scores(results, row, f"skill {m.name}") == skill_success(test, safe, m).tolist()
            )


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
        finetune_full(base, *data([sk], 1500), TrainConfig(epochs=4, batch_size=16, lr=1e-3))
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


# ---------------------------------------------------------------- the recipe's entry point


def test_entry_point_redraws_figures_from_the_summary_alone(tmp_path):
    """``python studies/toy_letters.py --plot-only`` reads results/toy/fast/summary.json only."""
    (tmp_path / "res" / "fast").mkdir(parents=True)
    summary = json.loads((ROOT / "results" / "toy" / "fast" / "summary.json").read_text())
    (tmp_path / "res" / "fast" / "summary.json").write_text(json.dumps(summary))
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "studies" / "toy_letters.py"),
            "--plot-only",
            "--results",
            str(tmp_path / "res"),
            "--figures",
            str(tmp_path / "fig"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        # As after `pip install -e .`, whatever the interpreter's own install points at.
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    names = sorted(p.name for p in (tmp_path / "fig").iterdir())
    assert names == [
        f"toy_{n}.png" for n in sorted(["diagnostics", "failures", "length", "letters", "spans"])
    ]
    authors = [
        r
        for r in summary
        if r["part"] == "authors"
        and r["method"] == "composition"
        and r["metric"] == "joint"
        and r["x"] is None
    ]
    assert [r["mean"] for r in authors] == [1.0, 1.0]


def test_a_finished_seed_is_reused_only_with_the_same_settings(tmp_path):
    from studies.toy.run import reusable
    from studies.toy.study import Settings

    path = tmp_path / "seed_1.json"
    assert not reusable(path, Settings())  # nothing there
    path.write_text(json.dumps({"settings": Settings(seeds=[1]).to_dict(), "records": []}))
    assert reusable(path, Settings(seeds=[0, 1, 2]))  # run alone, reused in the full list
    assert not reusable(path, Settings(n_train=1000))
    path.write_text("{not json")
    assert not reusable(path, Settings())


def test_parts_update_only_a_finished_seed_run_with_the_same_settings(tmp_path):
    from mergelab.errors import UserInputError
    from studies.toy.run import previous_run
    from studies.toy.study import Settings

    path = tmp_path / "seed_0.json"
    with pytest.raises(UserInputError, match="cannot read"):
        previous_run(path, Settings())
    older = Settings().to_dict()
    del older["n_validation"]  # a file from before a setting was added is still updated
    path.write_text(json.dumps({"settings": older, "records": []}))
    assert previous_run(path, Settings(seeds=[0]))["records"] == []
    with pytest.raises(UserInputError, match="other settings"):
        previous_run(path, Settings(n_train=1000))


def test_stop_outcomes_read_where_each_generation_stopped():
    from studies.toy.evaluate import stop_outcomes

    results = {
        "seeds": [0],
        "splits": {"0": {"joint": {"test": ["b", "a", "c"]}}},
        "runs": [
            {"split": "validation", "row": "composition", "benchmark": "joint", "stops": {}},
            {
                "split": "test",
                "row": "composition",
                "benchmark": "joint",
                "stops": {"a": [16, "eos"], "b": [8, "eos"], "c": [9, "length"]},
            },
        ],
    }
    out = stop_outcomes(results, "composition", "joint", 8)
    assert out["stop: EOS after the input's length"] == [1.0, 0.0, 0.0]  # split order b, a, c
    assert out["stop: EOS after 16 tokens"] == [0.0, 1.0, 0.0]
    assert out["stop: token limit"] == [0.0, 0.0, 1.0]


def test_figures_share_one_style():
    """Every toy figure from the committed summary: at most 3 panels per row, each titled; the
    letters bars in their family's colour (the same colour as in every mergelab figure)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    from mergelab import figure_style as fs
    from studies.toy import figures

    rows = json.loads((ROOT / "results" / "toy" / "fast" / "summary.json").read_text())
    for name, draw in figures.FIGURES.items():
        fig = draw(rows, "fast")
        per_row: dict[float, int] = {}
        for ax in fig.axes:
            y = round(ax.get_position().y0, 3)
            per_row[y] = per_row.get(y, 0) + 1
            assert ax.get_title() or ax.get_title(loc="left"), name
        assert max(per_row.values()) <= fs.MAX_COLUMNS, name
        if name == "letters":
            ax = fig.axes[0]
            labels = [t.get_text().split("\n")[0] for t in ax.get_yticklabels()]
            colors = [to_hex(p.get_facecolor()) for p in ax.patches]
            assert colors == [
                fs.family_color(fs.candidate_family(n.split(" [")[0])).lower() for n in labels
            ]
        plt.close(fig)
