"""evaluate(): scoring through the harness, the resume cache, outputs, and a real candidate."""

import json
import string
from dataclasses import replace
from pathlib import Path

import pytest

from mergelab.candidate import Generation, GenerationSettings
from mergelab.eval import (
    Benchmark,
    CodeTests,
    EvalSettings,
    Item,
    PromptConfig,
    compare,
    evaluate,
    load_gsm8k,
    load_humaneval_plus,
    load_math,
)
from mergelab.outputs import ForeignOutputError, OutputExistsError

FIXTURES = Path(__file__).parent / "fixtures" / "eval"


class FakeCandidate:
    """Returns canned text: the answer registered for the first key found in the prompt's
    last 400 characters (the item's own question), else ``default``. Counts prompts seen;
    with ``fail_after`` it raises once that many prompts have been generated (a crash)."""

    def __init__(self, answers, name="fake", default="I do not know.", fail_after=None):
        self.name = name
        self.tokenizer = None
        self.answers = answers
        self.default = default
        self.fail_after = fail_after
        self.seen = 0

    def generate(self, prompts, settings=None):
        if self.fail_after is not None and self.seen + len(prompts) > self.fail_after:
            raise RuntimeError("simulated crash in the middle of an evaluation")
        self.seen += len(prompts)
        out = []
        for p in prompts:
            tail = p[-400:]
            text = next((v for k, v in self.answers.items() if k in tail), self.default)
            out.append(Generation(prompt=p, text=text, token_ids=[0] * 3, finish_reason="eos"))
        return out

    def describe(self):
        return {"kind": "FakeCandidate", "name": self.name}

    def token_logprobs(self, input_ids, attention_mask=None):
        raise NotImplementedError

    def score(self, prompts, continuations):
        raise NotImplementedError


def _toy_math_benchmark(n=10):
    items = [
        Item(f"toy/{i}", f"What is {i} plus {i + 1}?", answer=str(2 * i + 1)) for i in range(n)
    ]
    return Benchmark.from_items("toy-sums", "gsm8k", items)


def _half_right(bench):
    # Right on even items, wrong on odd ones.
    return {
        it.prompt: (f"So the total is {it.answer}." if i % 2 == 0 else "The answer is 0.")
        for i, it in enumerate(bench.items)
    }


SETTINGS = EvalSettings(
    generation=GenerationSettings(max_new_tokens=16, batch_size=2),
    bootstrap_samples=2000,
)


def _strip_timing(items):
    return json.loads(json.dumps(items))


def test_gsm8k_scoring_through_the_harness(tmp_path):
    bench = load_gsm8k(FIXTURES / "gsm8k.jsonl")
    cand = FakeCandidate(
        {
            "Natalia": "48/2 = 24 in May, so 48 + 24 = 72 altogether.",
            "1,250 pens": "1,250 * 4 = 5,000 pens.",
            "temperature": "3 - 10 = 7 degrees.",  # wrong sign
        }
    )
    res = evaluate(cand, bench, SETTINGS, cache_dir=tmp_path, progress=False)
    assert [it["scores"]["accuracy"] for it in res.items] == [1.0, 1.0, 0.0]
    assert [it["samples"][0]["extracted"] for it in res.items] == ["72", "5,000", "7"]
    acc = res.summary["metrics"]["accuracy"]
    assert acc["mean"] == pytest.approx(2 / 3) and acc["low"] <= acc["mean"] <= acc["high"]
    strict = evaluate(
        cand,
        bench,
        replace(SETTINGS, gsm8k_extraction="strict"),
        cache_dir=tmp_path,
        progress=False,
    )
    assert strict.score() == 0.0  # no "####" / "The answer is" marker anywhere
    assert strict.summary["generated_this_call"] == 0  # same generations, rescored


def test_math_scoring_through_the_harness(tmp_path):
    bench = load_math(FIXTURES / "math.jsonl")
    cand = FakeCandidate(
        {
            "frac{1}{2} +": r"Common denominator: $\boxed{\dfrac{5}{6}}$.",
            "2x + 3": r"So $x = \boxed{-4.0}$.",
            "sqrt{\\frac{8}{9}}": r"$\boxed{\frac{\sqrt{8}}{3}}$",
        }
    )
    res = evaluate(cand, bench, SETTINGS, cache_dir=tmp_path, progress=False)
    assert res.score() == 1.0


def test_code_scoring_base_and_plus(tmp_path):
    bench = load_humaneval_plus(FIXTURES / "humaneval_plus.jsonl")
    canned = {it.prompt[-200:]: it.solution for it in bench.items}
    # HumanEval/0: passes the base inputs but fails the plus input with threshold 0.0.
    canned[bench.items[0].prompt[-200:]] = (
        "    for i, a in enumerate(numbers):\n        for j, b in enumerate(numbers):\n"
        "            if i != j and abs(a - b) <= threshold:\n                return True\n"
        "    return False\n"
    )
    res = evaluate(FakeCandidate(canned), bench, SETTINGS, cache_dir=tmp_path, progress=False)
    assert res.primary_metric == "pass@1_plus"
    scores = {it["item_id"]: it["scores"] for it in res.items}
    assert scores["HumanEval/0"] == {"pass@1_base": 1.0, "pass@1_plus": 0.0}
    assert (
        scores["HumanEval/2"] == scores["HumanEval/32"] == {"pass@1_base": 1.0, "pass@1_plus": 1.0}
    )
    assert res.items[0]["samples"][0]["plus"]["status"] == "failed"
    # the default sandbox isolates with namespaces, and the summary records what was in force
    assert res.summary["settings"]["isolation"] == "namespaces"
    isolation = res.summary["sandbox_isolation"]
    assert {"netns", "pidns", "mountns"} <= set(isolation) and "weak" not in isolation


def test_weak_isolation_only_when_asked_and_recorded(tmp_path):
    bench = load_humaneval_plus(FIXTURES / "humaneval_plus.jsonl")
    canned = {it.prompt[-200:]: it.solution for it in bench.items}
    settings = replace(SETTINGS, isolation="weak")
    res = evaluate(FakeCandidate(canned), bench, settings, cache_dir=tmp_path, progress=False)
    assert res.score() == 1.0
    assert res.summary["settings"]["isolation"] == "weak"
    assert "weak" in res.summary["sandbox_isolation"]
    assert "netns" not in res.summary["sandbox_isolation"]
    with pytest.raises(ValueError, match="isolation"):
        EvalSettings(isolation="none")


def test_resumed_evaluation_equals_uninterrupted(tmp_path):
    bench = _toy_math_benchmark(10)
    answers = _half_right(bench)
    full = evaluate(
        FakeCandidate(answers), bench, SETTINGS, cache_dir=tmp_path / "a", progress=False
    )

    crashing = FakeCandidate(answers, fail_after=5)  # batches of 2: 4 items done, then a crash
    with pytest.raises(RuntimeError, match="simulated crash"):
        evaluate(crashing, bench, SETTINGS, cache_dir=tmp_path / "b", progress=False)
    cached = (next((tmp_path / "b").iterdir()) / "generations.jsonl").read_text().splitlines()
    assert len(cached) == 4
    resumed_cand = FakeCandidate(answers)
    resumed = evaluate(resumed_cand, bench, SETTINGS, cache_dir=tmp_path / "b", progress=False)
    assert resumed_cand.seen == 6  # only the missing items were generated
    assert resumed.summary["generated_this_call"] == 6
    assert _strip_timing(resumed.items) == _strip_timing(full.items)
    assert resumed.summary["metrics"] == full.summary["metrics"]
    assert full.score() == 0.5

    # A run that completed is not regenerated at all; a torn last line is regenerated.
    again = FakeCandidate(answers)
    evaluate(again, bench, SETTINGS, cache_dir=tmp_path / "b", progress=False)
    assert again.seen == 0
    cache_file = resumed.run_dir / "generations.jsonl"
    lines = cache_file.read_text().splitlines()
    cache_file.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    torn = FakeCandidate(answers)
    after = evaluate(torn, bench, SETTINGS, cache_dir=tmp_path / "b", progress=False)
    assert torn.seen == 1 and _strip_timing(after.items) == _strip_timing(full.items)


def test_cache_key_separates_candidates_benchmarks_and_settings(tmp_path):
    bench = _toy_math_benchmark(4)
    a = FakeCandidate(_half_right(bench), name="a")
    evaluate(a, bench, SETTINGS, cache_dir=tmp_path, progress=False)
    b = FakeCandidate(_half_right(bench), name="b")
    evaluate(b, bench, SETTINGS, cache_dir=tmp_path, progress=False)
    assert b.seen == 4  # another candidate: nothing reused
    a2 = FakeCandidate(_half_right(bench), name="a")
    evaluate(
        a2,
        bench,
        replace(SETTINGS, prompt=PromptConfig(n_shots=2)),
        cache_dir=tmp_path,
        progress=False,
    )
    assert a2.seen == 4  # another prompt: regenerated
    evaluate(
        a2, bench, replace(SETTINGS, bootstrap_samples=500), cache_dir=tmp_path, progress=False
    )
    assert a2.seen == 4  # statistics settings do not touch generations
    a3 = FakeCandidate(_half_right(bench), name="a")
    evaluate(a3, bench, SETTINGS, cache_dir=tmp_path, limit=2, progress=False)
    assert a3.seen == 0  # a limited run reuses the full run's cache
    assert len(list(Path(tmp_path).iterdir())) == 3


def test_outputs_written_atomically_and_not_overwritten(tmp_path):
    bench = _toy_math_benchmark(4)
    out = tmp_path / "results" / "toy"
    res = evaluate(
        FakeCandidate(_half_right(bench)),
        bench,
        SETTINGS,
        cache_dir=tmp_path / "c",
        output_dir=out,
        progress=False,
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics"]["accuracy"]["mean"] == 0.5
    assert summary["candidate"] == {"kind": "FakeCandidate", "name": "fake"}
    assert summary["settings"]["seed"] == 0 and summary["benchmark"]["n_items"] == 4
    lines = (out / "items.jsonl").read_text().splitlines()
    assert [json.loads(x)["item_id"] for x in lines] == [it.item_id for it in bench.items]
    assert res.output_dir == out
    with pytest.raises(OutputExistsError):
        evaluate(
            FakeCandidate(_half_right(bench)),
            bench,
            SETTINGS,
            cache_dir=tmp_path / "c",
            output_dir=out,
            progress=False,
        )
    evaluate(
        FakeCandidate(_half_right(bench)),
        bench,
        SETTINGS,
        cache_dir=tmp_path / "c",
        output_dir=out,
        force=True,
        progress=False,
    )


def test_paired_comparison_of_two_candidates(tmp_path):
    bench = _toy_math_benchmark(10)
    good = FakeCandidate({it.prompt: f"It is {it.answer}." for it in bench.items}, name="good")
    half = FakeCandidate(_half_right(bench), name="half")
    ra = evaluate(good, bench, SETTINGS, cache_dir=tmp_path, progress=False)
    rb = evaluate(half, bench, SETTINGS, cache_dir=tmp_path, progress=False)
    cmp = compare(ra, rb, n_boot=2000)
    assert cmp["metric"] == "accuracy" and cmp["n_shared"] == 10
    assert cmp["paired_bootstrap"]["mean_diff"] == pytest.approx(0.5)
    assert cmp["mcnemar"]["a_only"] == 5 and cmp["mcnemar"]["b_only"] == 0
    assert cmp["mcnemar"]["p_value"] == pytest.approx(2 * 0.5**5)


def test_settings_validation():
    with pytest.raises(ValueError, match="pass_k"):
        EvalSettings(pass_k=(5,))
    with pytest.raises(ValueError, match="do_sample"):
        EvalSettings(n_samples=3, pass_k=(1,))


def test_sampled_pass_at_k_uses_every_sample(tmp_path):
    tests = CodeTests("inc", check="def check(f):\n    assert f(1) == 2\n")
    bench = Benchmark.from_items("toy-code", "code", [Item("inc", "def inc(x):\n", tests=tests)])

    class Alternating(FakeCandidate):
        def generate(self, prompts, settings=None):
            # Sample j (seed j) is right for even seeds only.
            ok = settings.seed % 2 == 0
            body = "    return x + 1\n" if ok else "    return x\n"
            self.seen += len(prompts)
            return [Generation(p, body, [0], "eos") for p in prompts]

    settings = EvalSettings(
        generation=GenerationSettings(do_sample=True, seed=0, batch_size=4),
        n_samples=4,
        pass_k=(1, 2),
        bootstrap_samples=200,
    )
    res = evaluate(Alternating({}), bench, settings, cache_dir=tmp_path, progress=False)
    assert res.items[0]["scores"]["pass@1_base"] == pytest.approx(0.5)
    assert res.items[0]["scores"]["pass@2_base"] == pytest.approx(1 - 1 / 6)


def test_with_a_real_model_candidate(tmp_path):
    """Integration: a tiny random GPT-2 wrapped by mergelab.ModelCandidate."""
    from mergelab import ModelCandidate
    from mergelab.tiny import char_tokenizer, tiny_causal_lm

    tok = char_tokenizer()
    model = tiny_causal_lm(len(tok), seed=0)
    cand = ModelCandidate(model, tok, name="tiny-gpt2")
    bench = Benchmark.from_items(
        "tiny-code",
        "code",
        [
            Item(
                f"t{i}",
                f"def f{i}(x):\n    return ",
                tests=CodeTests(f"f{i}", asserts=(f"assert f{i}(1) == 1",)),
            )
            for i in range(3)
        ],
    )
    settings = EvalSettings(
        generation=GenerationSettings(max_new_tokens=6, batch_size=3), bootstrap_samples=200
    )
    first = evaluate(cand, bench, settings, cache_dir=tmp_path, progress=False)
    assert first.summary["generated_this_call"] == 3
    assert all(
        s["base"]["status"] in ("passed", "failed", "crashed")
        for it in first.items
        for s in it["samples"]
    )
    second = evaluate(cand, bench, settings, cache_dir=tmp_path, progress=False)
    assert second.summary["generated_this_call"] == 0
    assert _strip_timing(second.items) == _strip_timing(first.items)
    assert first.summary["candidate"] == cand.describe()


def test_cli_run_and_compare(tmp_path, capsys):
    """`mergelab eval run` on a saved tiny model, twice (a resume), then `compare`."""
    from mergelab.cli import main
    from mergelab.tiny import char_tokenizer, tiny_causal_lm

    tok = char_tokenizer(string.printable)  # GSM8K text has capitals, digits, punctuation
    model_dir = tmp_path / "tiny"
    tiny_causal_lm(len(tok), seed=0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    common = [
        "eval",
        "run",
        "--model",
        str(model_dir),
        "--benchmark",
        "gsm8k",
        "--data",
        str(FIXTURES / "gsm8k.jsonl"),
        "--max-new-tokens",
        "4",
        "--n-shots",
        "0",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--out", str(tmp_path / "b")]) == 0
    assert main([*common, "--out", str(tmp_path / "b")]) == 2  # exists, no --force
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["generated_this_call"] == 3 and summary["n_items"] == 3
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["generated_this_call"] == 0
    capsys.readouterr()
    assert (
        main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--n-boot", "200"]) == 0
    )
    out = capsys.readouterr().out
    assert "a - b = +0.0" in out and "on 3 shared items" in out


def test_outputs_are_checked_before_anything_is_generated(tmp_path):
    bench = _toy_math_benchmark(4)
    out = tmp_path / "out"
    out.mkdir()
    (out / "paper.tex").write_text("the user's file")
    cand = FakeCandidate(_half_right(bench))
    with pytest.raises(OutputExistsError, match="--force"):
        evaluate(cand, bench, SETTINGS, cache_dir=tmp_path / "c", output_dir=out, progress=False)
    with pytest.raises(ForeignOutputError, match="paper.tex"):
        evaluate(
            cand,
            bench,
            SETTINGS,
            cache_dir=tmp_path / "c",
            output_dir=out,
            force=True,
            progress=False,
        )
    with pytest.raises(ValueError, match="overlaps input"):
        evaluate(
            cand,
            bench,
            SETTINGS,
            cache_dir=tmp_path / "c",
            output_dir=tmp_path / "c" / "results",
            progress=False,
        )
    assert cand.seen == 0 and (out / "paper.tex").read_text() == "the user's file"


@pytest.mark.parametrize("limit", [0, -1, True, 2.5])
def test_limit_must_be_at_least_one(tmp_path, limit):
    bench = _toy_math_benchmark(4)
    cand = FakeCandidate(_half_right(bench))
    with pytest.raises(ValueError, match="limit must be a number of items"):
        evaluate(cand, bench, SETTINGS, cache_dir=tmp_path, limit=limit, progress=False)
    assert cand.seen == 0


@pytest.fixture
def saved_tiny_model(tmp_path):
    from mergelab.tiny import char_tokenizer, tiny_causal_lm

    tok = char_tokenizer(string.printable)
    model_dir = tmp_path / "tiny"
    tiny_causal_lm(len(tok), seed=0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir


def test_cli_run_refuses_an_existing_out_before_loading_the_model(
    saved_tiny_model, tmp_path, capsys, monkeypatch
):
    import transformers

    from mergelab.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the output was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    out = tmp_path / "results"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    common = [
        "eval",
        "run",
        "--model",
        str(saved_tiny_model),
        "--benchmark",
        "gsm8k",
        "--data",
        str(FIXTURES / "gsm8k.jsonl"),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(out),
    ]
    assert main(common) == 2
    assert "already exists" in capsys.readouterr().err
    assert main([*common, "--force"]) == 2
    assert "mergelab did not write: keep.txt" in capsys.readouterr().err
    inside = [*common[:-1], str(saved_tiny_model / "results")]
    assert main(inside) == 2
    assert "overlaps input" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("value", ["0", "-1", "many"])
def test_cli_limit_below_one_is_refused(tmp_path, capsys, value):
    from mergelab.cli import main

    argv = ["eval", "run", "--model", str(tmp_path), "--benchmark", "gsm8k", "--limit", value]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and "argument --limit" in capsys.readouterr().err


def test_batches_hold_prompts_of_similar_length(tmp_path):
    """Items are generated longest prompt first, so a batch's prompts differ little in length
    (little left padding), whatever the benchmark's order; results keep the benchmark's order."""
    lengths = [1, 40, 3, 38, 2, 41, 39, 4]
    items = [Item(f"q/{i}", "x" * n, answer="1") for i, n in enumerate(lengths)]
    bench = Benchmark.from_items("mixed-lengths", "gsm8k", items)

    class Recording(FakeCandidate):
        batches: list[list[int]] = []

        def generate(self, prompts, settings=None):
            self.batches.append(sorted(p.count("x") for p in prompts))
            return super().generate(prompts, settings)

    fake = Recording({})
    settings = replace(SETTINGS, prompt=PromptConfig(n_shots=0))
    result = evaluate(fake, bench, settings, cache_dir=tmp_path / "cache", progress=False)
    assert fake.batches == [[40, 41], [38, 39], [3, 4], [1, 2]]
    assert [it["item_id"] for it in result.items] == [it.item_id for it in items]
