"""The task registry: every benchmark names a task; prompts, stops and scoring go through it."""

import json
from dataclasses import replace

import pytest

from mergelab.eval import Benchmark, EvalSettings, Item, PromptConfig, build_prompt, evaluate
from mergelab.eval.benchmarks import load_items
from mergelab.eval.prompts import GSM8K_STOPS, HUMANEVAL_STOPS, stop_strings
from mergelab.eval.scoring_math import answer_scorer, extract_final_answer_line
from mergelab.eval.tasks import (
    Task,
    UnknownTaskError,
    baseline_completions,
    get_task,
    list_tasks,
    register_task,
    score_completions,
)
from mergelab.synthetic import draw_benchmark

WEAK = EvalSettings(isolation="weak", bootstrap_samples=100)


def test_builtin_tasks_and_a_clear_error():
    names = list_tasks()
    for name in [
        "gsm8k",
        "math",
        "humaneval",
        "mbpp",
        "code",
        "synth_math",
        "synth_count",
        "synth_code",
        "synth_mixed",
    ]:
        assert name in names
        assert get_task(name).name == name
    assert get_task("humaneval").kind == "code" and get_task("synth_count").kind == "math"
    with pytest.raises(UnknownTaskError, match=r"unknown task 'trivia'; known tasks: \['code'"):
        get_task("trivia")
    with pytest.raises(ValueError, match="already registered"):
        register_task(replace(get_task("gsm8k"), description="another"))
    with pytest.raises(ValueError, match="kind must be one of"):
        Task("x", "essay", load=None, build_prompt=None, score=None)


def test_strict_final_line_for_synthetic_answers():
    assert extract_final_answer_line(" 3 + 4 = 7\n#### 7\n") == "7"
    assert extract_final_answer_line(" 1 apple\n2 pear\n3 fig") is None  # a count, no answer line
    assert extract_final_answer_line("#### 7\nmore text") is None  # not the final line
    assert extract_final_answer_line("The answer is 7.") is None
    assert extract_final_answer_line("") is None
    bench = draw_benchmark("count", n=12, seed=3)
    gold = {it.item_id: it.solution for it in bench.items}
    assert all(score_completions(bench, gold, WEAK).values())
    # Cut the "#### n" line: flexible GSM8K extraction would still find n in "n word"; strict not.
    enumerations = {i: text.rsplit("\n", 1)[0] for i, text in gold.items()}
    assert not any(score_completions(bench, enumerations, WEAK).values())
    flexible = Benchmark("as-gsm8k", "gsm8k", bench.items)
    assert all(score_completions(flexible, enumerations, WEAK).values())


def test_synthetic_prompts_and_sum_of_numbers_baselines():
    math = draw_benchmark("math", n=30, seed=1)
    item = math.items[0]
    assert build_prompt(item, math, PromptConfig()) == f"Q: {item.prompt}\nA:"
    assert stop_strings(math) == GSM8K_STOPS
    floor = baseline_completions(math, "sum_of_numbers")
    numbers = [int(w.rstrip(".?")) for w in item.prompt.split() if w.rstrip(".?").isdigit()]
    assert floor[item.item_id] == f" #### {sum(numbers)}"
    got = score_completions(math, floor, WEAK)
    # Right exactly when every step of the story adds: the floor is not a trivial 0 or 100%.
    adds_only = {
        it.item_id: all(w not in it.prompt for w in ("gives", "loses", "sells"))
        for it in math.items
    }
    assert got == adds_only and 0 < sum(got.values()) < len(got)

    mixed = draw_benchmark("mixed", n=10, seed=1)
    assert stop_strings(mixed) == HUMANEVAL_STOPS
    programs = baseline_completions(mixed, "sum_of_numbers")
    assert all(p.startswith("    return ") for p in programs.values())
    gold = {it.item_id: it.solution for it in mixed.items}
    assert all(score_completions(mixed, gold, WEAK).values())
    got = score_completions(mixed, programs, WEAK)
    adds_only = {it.item_id: " - " not in it.solution for it in mixed.items}
    assert got == adds_only
    with pytest.raises(UnknownTaskError, match="no baseline 'copy'"):
        baseline_completions(mixed, "copy")
    with pytest.raises(ValueError, match="no completion for 1 item"):
        score_completions(mixed, dict(list(gold.items())[1:]), WEAK)


def test_study_items_keep_their_ids_and_split(tmp_path):
    from mergelab.synthetic import make_splits

    splits = make_splits("math", {"validation": 5, "test": 7, "train": 20}, seed=0)
    bench = get_task("synth_math").load(splits["test"], name="synthetic-math-test")
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(it) + "\n" for it in splits["test"]))
    again = get_task("synth_math").load(path, name="synthetic-math-test")
    assert again.items == bench.items
    assert (bench.name, bench.task, len(bench)) == ("synthetic-math-test", "synth_math", 7)
    assert [it.item_id for it in bench.items] == [it["id"] for it in splits["test"]]
    assert bench.items[0].answer == splits["test"][0]["answer"]


def test_adding_a_task_is_one_registration(tmp_path):
    """A new task: loader + prompt + scorer; evaluate(), prompts and stops need no change."""

    def check(text, item, settings):
        return text.strip() == item.answer, text.strip()  # case counts

    task = register_task(
        Task(
            name="test_echo_word",
            kind="math",
            load=lambda path, limit=None: load_items(path, "test_echo_word", limit),
            build_prompt=lambda item, config: f"Say {item.prompt}:",
            score=answer_scorer(check),
            stop_strings=lambda bench: ("\n",),
            baselines={"copy": lambda item: item.prompt},
        )
    )
    data = tmp_path / "words.jsonl"
    data.write_text(
        "".join(
            json.dumps({"item_id": w, "prompt": w.upper(), "answer": w}) + "\n"
            for w in ["cat", "dog"]
        )
    )
    bench = task.load(data)
    assert bench.task == "test_echo_word" and stop_strings(bench) == ("\n",)

    class Echo:  # a candidate that repeats the word it is asked for
        name = "echo"
        tokenizer = None

        def describe(self):
            return {"name": "echo"}

        def generate(self, prompts, settings):
            from mergelab.candidate import Generation

            return [
                Generation(prompt=p, text=" " + p[4:-1].lower(), token_ids=[0], finish_reason="eos")
                for p in prompts
            ]

    result = evaluate(Echo(), bench, WEAK, cache_dir=tmp_path / "cache", progress=False)
    assert result.score() == 1.0
    assert [it["prompt"] for it in result.items] == ["Say CAT:", "Say DOG:"]
    assert score_completions(bench, baseline_completions(bench, "copy"), WEAK) == {
        "cat": False,
        "dog": False,
    }


def test_item_files_round_trip(tmp_path):
    from mergelab.eval import CodeTests
    from mergelab.eval.benchmarks import BenchmarkFormatError

    items = [
        Item("f1", "def f():\n", tests=CodeTests(entry_point="f", asserts=("assert f() == 1",)))
    ]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(it.to_dict()) + "\n" for it in items))
    bench = load_items(path, "code")
    assert bench.items == items and bench.name == "code"
    path.write_text(json.dumps({"prompt": "x", "colour": "red"}) + "\n")
    with pytest.raises(
        BenchmarkFormatError, match=r"code.jsonl:1: unknown item fields \['colour'\]"
    ):
        load_items(path, "gsm8k")
