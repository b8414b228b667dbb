"""``mergelab compare --example letters`` and its ``letter_map`` task: exact-match scoring, the
benchmark items, the spec file, and a shortened run of the example end to end (tiny budgets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergelab.cli import main as cli_main
from mergelab.eval.benchmarks import Benchmark, Item
from mergelab.eval.harness import EvalSettings
from mergelab.eval.letter_tasks import generated_string, letter_correct, letter_prompt
from mergelab.eval.tasks import baseline_completions, get_task, score_completions


def _bench(pairs):
    items = [Item(str(i), x, answer=y) for i, (x, y) in enumerate(pairs)]
    return Benchmark("letters", "letter_map", items)


def test_scoring_is_exact_match_up_to_eos():
    assert letter_correct("BXYZ", "BXYZ")
    assert letter_correct("BXYZ[EOS]", "BXYZ")
    assert letter_correct("BXYZ[EOS]junk", "BXYZ")
    assert not letter_correct("BXYZ ", "BXYZ")  # a trailing space is a different string
    assert not letter_correct(" BXYZ", "BXYZ")
    assert not letter_correct("bxyz", "BXYZ")
    assert not letter_correct("BXY", "BXYZ")
    assert not letter_correct("BXYZB", "BXYZ")
    # cut by the token limit: right only if the model did end the string
    assert not letter_correct("BXYZ", "BXYZ", finish_reason="length")
    assert letter_correct("BXYZ[EOS]", "BXYZ", finish_reason="length")
    assert letter_correct("A B", "A B", finish_reason="stop")
    assert generated_string("AB[EOS]CD[EOS]") == "AB"
    with pytest.raises(ValueError, match="answer"):
        letter_correct("AB", None)


def test_score_completions_and_copy_baseline():
    bench = _bench([("AXC", "BXD"), ("AAQ", "BBQ"), ("Q Q", "Q Q")])
    settings = EvalSettings()
    answers = {"0": "BXD[EOS]", "1": "BBQ ", "2": "Q Q"}
    assert score_completions(bench, answers, settings) == {"0": True, "1": False, "2": True}
    copy = baseline_completions(bench, "copy")
    assert copy == {"0": "AXC", "1": "AAQ", "2": "Q Q"}
    assert score_completions(bench, copy, settings) == {"0": False, "1": False, "2": True}
    task = get_task("letter_map")
    assert task.kind == "math"  # an answer task: no chat code instruction, no sandbox
    scores = task.score(
        bench,
        {
            "0": [{"text": "BXD", "finish_reason": "eos"}, {"text": "BXC", "finish_reason": "eos"}],
            "1": [{"text": "BBQ", "finish_reason": "length"}],
            "2": [{"text": "Q Q[EOS]", "finish_reason": "length"}],
        },
        settings,
    )
    assert scores.primary == "accuracy"
    assert scores.metrics["accuracy"] == [0.5, 0.0, 1.0]


def test_prompt_ends_with_the_training_separator():
    from mergelab.toy.tasks import GenerativeTask
    from mergelab.toy.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    item = Item("0", "AB C", answer="BB D")
    prompt = letter_prompt(item)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.sep_token_id and len(ids) == 5
    assert prompt == GenerativeTask(tok).prompt("AB C")


def test_loader_reads_jsonl_and_refuses_items_without_answer(tmp_path):
    task = get_task("letter_map")
    path = tmp_path / "items.jsonl"
    path.write_text(
        '{"item_id": "x", "prompt": "AQ", "answer": "BQ"}\n{"prompt": "CQ", "answer": "DQ"}\n'
    )
    bench = task.load(path)
    assert [(it.item_id, it.prompt, it.answer) for it in bench.items] == [
        ("x", "AQ", "BQ"),
        ("1", "CQ", "DQ"),
    ]
    path.write_text('{"item_id": "x", "prompt": "AQ"}\n')
    with pytest.raises(ValueError, match="answer"):
        task.load(path)


def test_benchmark_items_meet_their_conditions():
    from mergelab.compare.example import letter_benchmark_items

    items = letter_benchmark_items(30, seed=3, length=6)
    assert items == letter_benchmark_items(30, seed=3, length=6)
    strings = [r["prompt"] for recs in items.values() for r in recs]
    assert len(set(strings)) == len(strings) == 90  # no string in two benchmarks
    for name, recs in items.items():
        for r in recs:
            s = r["prompt"]
            assert len(s) == 6
            assert r["answer"] == s.replace("A", "B").replace("C", "D") != s
            assert ("A" in s, "C" in s) == {
                "a_to_b": (True, False),
                "c_to_d": (False, True),
                "both": (True, True),
            }[name]
    excluded = letter_benchmark_items(30, seed=3, length=6, exclude=frozenset(strings[:10]))
    assert not set(strings[:10]) & {r["prompt"] for recs in excluded.values() for r in recs}


def test_example_spec_file_is_the_builtin_one():
    from mergelab.compare.example import letters_spec_text

    example = Path(__file__).parents[1] / "examples" / "compare_letters.yaml"
    assert example.read_text() == letters_spec_text()


def test_example_choice_dispatches_and_tiny_keeps_its_cache_folder(tmp_path, monkeypatch):
    import mergelab.compare.example as ex

    called = []

    def spy(folder, progress=True):
        called.append(Path(folder))
        raise SystemExit(0)  # stop after the dispatch: nothing to train here

    monkeypatch.setitem(ex.EXAMPLES, "tiny", spy)
    monkeypatch.setitem(ex.EXAMPLES, "letters", spy)
    for name in ("tiny", "letters"):
        with pytest.raises(SystemExit):
            cli_main(["compare", "--example", name, "--cache", str(tmp_path), "--dry-run"])
    assert called == [tmp_path / "example", tmp_path / "example-letters"]


def test_shortened_example_runs_end_to_end(tmp_path, monkeypatch, capsys):
    """The whole example on tiny training budgets (the models are then weak): the spec parses,
    the run writes the table with every family and the copy floor, and a rerun reuses the
    trained models."""
    import mergelab.compare as mc
    import mergelab.compare.example as ex
    from mergelab.compare.spec import load_spec

    monkeypatch.setitem(ex.LETTERS_TRAIN, "base_steps", 20)
    monkeypatch.setitem(ex.LETTERS_TRAIN, "expert_steps", 5)
    folder = tmp_path / "cache" / "example-letters"  # where the CLI looks for it
    spec_path = ex.prepare_letters_example(folder, progress=False)
    spec = load_spec(spec_path)
    assert [b.name for b in spec.benchmarks] == ["a_to_b", "c_to_d", "both"]
    recipe = json.loads((folder / "recipe.json").read_text())
    assert recipe["recipe"]["train"]["base_steps"] == 20 and recipe["cpu_seconds"] > 0
    weights = folder / "models" / "a_to_b" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ex.prepare_letters_example(folder, progress=False) == spec_path
    assert weights.stat().st_mtime_ns == stamp  # reused, not retrained

    out = tmp_path / "out"
    cache = tmp_path / "cache"
    argv = ["compare", "--example", "letters", "--out", str(out), "--cache", str(cache)]
    assert cli_main([*argv, "--no-progress"]) == 0
    table = capsys.readouterr().out
    results = mc.load_results(out / "results.json")
    rows = {r["row"] for r in results["runs"] if r["split"] == "test"}
    assert rows == {
        "base",
        "a_to_b",
        "c_to_d",
        "composition",
        "task_arithmetic",
        "ties",
        "dare_ties",
        "linear",
    }
    for bench in ("a_to_b", "c_to_d", "both"):
        assert f"- baseline `copy` on {bench}: 0.0 [0.0, 0.0]" in table
        assert len(results["splits"]["0"][bench]["test"]) == 100
    assert weights.stat().st_mtime_ns == stamp
