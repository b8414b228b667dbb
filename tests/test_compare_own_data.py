"""Your own data in `mergelab compare` and `mergelab eval`: the generic tasks (exact match,
normalised match, regex, multiple choice by log-likelihood) over JSONL/JSON/CSV/Parquet/datasets
records with field templates; bad templates refused at --dry-run; paired statistics per item.

The models are tiny random Llamas over a character tokenizer (as in test_compare.py); the
multiple-choice outcomes are checked against the candidates' own log-likelihoods.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from mergelab.eval import EvalSettings, evaluate, get_task, load_benchmark, score_completions
from mergelab.eval.benchmarks import BenchmarkFormatError
from mergelab.eval.generic_tasks import GENERIC_TASKS, load_generic, normalize_answer

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 >?\n"
# An lm-eval-style file: x, y, choices, label (y is the labelled choice).
LM_EVAL_RECORDS = [
    {
        "x": f"{a} plus {b} is",
        "y": str(a + b),
        "choices": [str(a + b + d) for d in (-1, 0, 1, 2)][::-1]
        if i % 2
        else [str(a + b + d) for d in (0, 1, 2, -1)],
        "label": None,
    }
    for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 1), (2, 2), (7, 1), (4, 4), (6, 3), (0, 5)])
]
for _r in LM_EVAL_RECORDS:
    _r["label"] = _r["choices"].index(_r["y"])


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _tokenizer():
    from mergelab.tiny import char_tokenizer

    return char_tokenizer(ALPHABET, bos=None, unk="<unk>", padding_side="left")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mergelab.tiny import tiny_llama

    tok = _tokenizer()
    root = tmp_path_factory.mktemp("own_data")
    out = {}
    for i, name in enumerate(("base", "math", "code")):
        m = tiny_llama(tok, hidden_size=32, num_layers=2, seed=0, initializer_range=0.3)
        if i:
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = m
    return {"tok": tok, "root": root, **out}


# ----------------------------------------------------------------------------------------------
# Reading records through field templates


def test_lm_eval_style_jsonl_as_answers_and_as_choices(tmp_path):
    path = _write_jsonl(tmp_path / "sums.jsonl", LM_EVAL_RECORDS)
    em = load_generic(path, task="exact_match", fields={"prompt": "{x}>", "target": "{y}"})
    assert em.task == "exact_match" and len(em) == 8
    assert (em.items[0].item_id, em.items[0].prompt, em.items[0].answer) == (
        "1",
        "1 plus 2 is>",
        "3",
    )
    by_label = load_generic(
        path,
        task="multiple_choice",
        fields={"prompt": "{x}", "choices": "choices", "label": "label"},
    )
    by_target = load_generic(
        path, task="multiple_choice", fields={"prompt": "{x}", "choices": "choices", "target": "y"}
    )
    for a, b, rec in zip(by_label.items, by_target.items, LM_EVAL_RECORDS):
        assert a.meta["label"] == b.meta["label"] == rec["label"]
        assert a.answer == rec["y"] and a.meta["choices"] == rec["choices"]
    # the registry reaches the same loader (mergelab eval --benchmark exact_match --data ...)
    again = load_benchmark(
        "exact_match", path, options={"fields": {"prompt": "{x}>", "target": "y"}}
    )
    assert [it.to_dict() for it in again.items] == [it.to_dict() for it in em.items]


def test_csv_parquet_and_datasets_folder_give_the_same_items(tmp_path):
    import csv

    rows = [
        {
            "id": f"r{i}",
            "q": r["x"],
            "a": r["choices"][0],
            "b": r["choices"][1],
            "c": r["choices"][2],
            "d": r["choices"][3],
            "answer": str(r["label"]),
        }
        for i, r in enumerate(LM_EVAL_RECORDS)
    ]
    fields = {
        "id": "id",
        "prompt": "Q: {q}\nA:",
        "choices": ["{a}", "{b}", "{c}", "{d}"],
        "label": "answer",
    }
    with open(tmp_path / "sums.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    from_csv = load_generic(tmp_path / "sums.csv", task="multiple_choice", fields=fields)
    (tmp_path / "list.json").write_text(json.dumps(rows))
    from_list = load_generic(tmp_path / "list.json", task="multiple_choice", fields=fields)
    assert [it.to_dict() for it in from_csv.items] == [it.to_dict() for it in from_list.items]
    assert [it.meta["label"] for it in from_csv.items] == [r["label"] for r in LM_EVAL_RECORDS]

    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sums.parquet")
    from_parquet = load_generic(tmp_path / "sums.parquet", task="multiple_choice", fields=fields)
    assert [it.to_dict() for it in from_parquet.items] == [it.to_dict() for it in from_csv.items]

    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
    dd.save_to_disk(str(tmp_path / "hf"))
    from_hf = load_generic(tmp_path / "hf", task="multiple_choice", fields=fields, split="test")
    assert [it.to_dict() for it in from_hf.items] == [it.to_dict() for it in from_csv.items]
    with pytest.raises(BenchmarkFormatError, match="name its split with `split:`"):
        load_generic(tmp_path / "hf", task="multiple_choice", fields=fields)


@pytest.mark.parametrize(
    "task, fields, words",
    [
        (
            "exact_match",
            {"prompt": "{question}>", "target": "{y}"},
            "sums.jsonl:1: field 'question' (used by fields.prompt: '{question}>') is not in the "
            "record; it has x, y, choices, label",
        ),
        (
            "multiple_choice",
            {"prompt": "{x}", "choices": "options", "label": "label"},
            "field 'options' (used by fields.choices",
        ),
        (
            "multiple_choice",
            {"prompt": "{x}", "choices": "choices", "target": "x"},
            "is neither a choice index nor one of",
        ),
    ],
)
def test_a_field_missing_in_the_file_names_the_field_and_the_line(tmp_path, task, fields, words):
    path = _write_jsonl(tmp_path / "sums.jsonl", LM_EVAL_RECORDS)
    with pytest.raises(BenchmarkFormatError) as exc:
        load_generic(path, task=task, fields=fields)
    assert words in str(exc.value) and str(path) in str(exc.value)


def test_answer_scorers(tmp_path):
    from mergelab.eval.harness import EvalSettings

    recs = [{"q": "capital of france", "a": "Paris"}, {"q": "2+2", "a": "4"}]
    path = _write_jsonl(tmp_path / "qa.jsonl", recs)
    settings = EvalSettings()
    fields = {"prompt": "{q}", "target": "a"}
    em = load_generic(path, task="exact_match", fields=fields)
    assert score_completions(em, {"1": " Paris \nmore", "2": "four"}, settings) == {
        "1": True,
        "2": False,
    }
    assert score_completions(em, {"1": "paris", "2": "4"}, settings) == {"1": False, "2": True}
    nm = load_generic(path, task="normalized_match", fields=fields)
    assert score_completions(nm, {"1": "the PARIS.", "2": "4!"}, settings) == {"1": True, "2": True}
    assert normalize_answer("The  Cat, a dog!") == "cat dog"
    rx = load_generic(path, task="regex", fields={**fields, "pattern": r"answer is (\w+)"})
    got = score_completions(rx, {"1": "well...\nthe answer is Paris.", "2": "4"}, settings)
    assert got == {"1": True, "2": False}  # no match is wrong
    assert get_task("regex").stop_strings(rx) == () and get_task("exact_match").stop_strings(em)


def test_multiple_choice_is_the_argmax_of_the_candidates_log_likelihoods(models, tmp_path):
    from mergelab import ModelCandidate

    path = _write_jsonl(tmp_path / "sums.jsonl", LM_EVAL_RECORDS)
    bench = load_generic(
        path,
        task="multiple_choice",
        fields={"prompt": "{x}", "choices": "choices", "label": "label"},
    )
    cand = ModelCandidate(models["math"], models["tok"], name="math")
    result = evaluate(cand, bench, EvalSettings(), cache_dir=tmp_path / "cache", progress=False)
    assert result.primary_metric == "acc"
    for it, scored in zip(bench.items, result.items):
        lls = cand.score([it.prompt] * 4, [" " + c for c in it.meta["choices"]])
        pred = max(range(4), key=lambda i: (lls[i], -i))
        norm = [ll / len(c) for ll, c in zip(lls, it.meta["choices"])]
        pred_norm = max(range(4), key=lambda i: (norm[i], -i))
        assert scored["samples"][0]["loglikelihoods"] == pytest.approx(lls, abs=1e-5)
        assert scored["scores"] == {
            "acc": float(pred == it.meta["label"]),
            "acc_norm": float(pred_norm == it.meta["label"]),
        }
    # a second call reads the cache and scores nothing again
    again = evaluate(cand, bench, EvalSettings(), cache_dir=tmp_path / "cache", progress=False)
    assert again.summary["generated_this_call"] == 0 and again.items == result.items


# ----------------------------------------------------------------------------------------------
# In a compare spec, from the CLI


def _spec(models, tmp_path: Path, benchmarks) -> Path:
    root = models["root"]
    spec = {
        "name": "own-data",
        "models": {
            "base": str(root / "base"),
            "experts": {"math": str(root / "math"), "code": str(root / "code")},
        },
        "candidates": [
            {"family": "base"},
            {"family": "expert"},
            {"family": "merge", "method": "task_arithmetic", "grid": {"lambda": [0.5, 1.0]}},
        ],
        "benchmarks": benchmarks,
        "generation": {"max_new_tokens": 4, "batch_size": 8},
        "statistics": {"bootstrap_samples": 200},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _compare(capsys, *args):
    """``mergelab compare ARGS`` in this process: (exit code, stdout, stderr)."""
    from mergelab.cli import main

    code = main(["compare", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_compare_spec_with_own_jsonl_runs_with_paired_statistics(models, tmp_path, capsys):
    _write_jsonl(tmp_path / "sums.jsonl", LM_EVAL_RECORDS * 2)  # ids are line numbers: 16 items
    benchmarks = [
        {
            "name": "sums_mc",
            "file": "sums.jsonl",
            "task": "multiple_choice",
            "fields": {"prompt": "{x}", "choices": "choices", "label": "label"},
            "split": {"validation": 6, "test": "rest"},
        },
        {
            "name": "sums_em",
            "file": "sums.jsonl",
            "task": "exact_match",
            "fields": {"prompt": "{x}>", "target": "{y}"},
            "validation_from": "sums_mc",
        },
    ]
    spec = _spec(models, tmp_path, benchmarks)
    code, plan, err = _compare(capsys, spec, "--dry-run")
    assert code == 0, err
    assert "multiple_choice validation 6, test 10" in plan
    out = tmp_path / "out"
    code, _, err = _compare(capsys, spec, "--out", out, "--no-progress")
    assert code == 0, err[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["benchmarks"]["sums_mc"]["task"] == "multiple_choice"
    stats = results["statistics"]["per_seed"]["0"]
    # sums_em borrows sums_mc's validation: its test split is all 16 items
    for bench, metric, n in (("sums_mc", "acc", 10), ("sums_em", "accuracy", 16)):
        tests = [r for r in results["runs"] if r["benchmark"] == bench and r["split"] == "test"]
        assert len(tests) == 4 and {r["row"] for r in tests} >= {"base", "math", "code"}
        assert all(r["metric"] == metric and len(r["items"]) == n for r in tests)
        assert all(set(r["items"].values()) <= {0.0, 1.0} for r in tests)
        pair = stats[bench]["pairwise"]["base vs math"]
        assert pair["n"] == n and "mcnemar" in pair  # paired per item: McNemar applies
        base = next(r for r in tests if r["row"] == "base")["items"]
        math = next(r for r in tests if r["row"] == "math")["items"]
        discordant = sum(base[i] != math[i] for i in base)
        assert pair["mcnemar"]["a_only"] + pair["mcnemar"]["b_only"] == discordant
    # Costs: scored tokens (every choice's continuation) for multiple choice, generated for
    # exact match; measured, not 0, and labelled in the table.
    tok = models["tok"]
    by_id = {str(i + 1): r for i, r in enumerate(LM_EVAL_RECORDS * 2)}  # ids: line numbers
    for r in results["runs"]:
        cost = r["cost"]
        assert cost["ms_per_token"] > 0 and cost["ms_per_item"] > 0
        if r["benchmark"] == "sums_mc":
            scored = [
                sum(
                    len(tok(" " + c, add_special_tokens=False)["input_ids"]) for c in rec["choices"]
                )
                for rec in (by_id[i] for i in r["items"])
            ]
            assert cost["tokens_counted"] == "scored" and cost["mean_new_tokens"] == 0
            assert cost["tokens_per_item"] == pytest.approx(sum(scored) / len(scored))
            assert min(scored) > 0
        else:
            assert cost["tokens_counted"] == "generated"
            assert cost["tokens_per_item"] == pytest.approx(cost["mean_new_tokens"])
    table = (out / "table.md").read_text()
    head = next(line for line in table.splitlines() if line.startswith("| candidate"))
    assert head.endswith("| model evals/token | tokens/item | ms/token |")
    base_row = next(line for line in table.splitlines() if line.startswith("| base |"))
    assert base_row.count("(scored)") == 2 and base_row.count("(generated)") == 2
    assert "*scored* tokens" in table


def test_a_bad_template_is_one_line_and_exit_2_at_dry_run(models, tmp_path, capsys):
    _write_jsonl(tmp_path / "sums.jsonl", LM_EVAL_RECORDS)
    spec = _spec(
        models,
        tmp_path,
        [
            {
                "name": "sums",
                "file": "sums.jsonl",
                "task": "exact_match",
                "fields": {"prompt": "{question}", "target": "{y}"},
                "split": {"validation": 2},
            }
        ],
    )
    code, _, err = _compare(capsys, spec, "--dry-run")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "benchmarks[sums]" in lines[0] and "field 'question'" in lines[0]
    assert str(tmp_path / "sums.jsonl") + ":1" in lines[0]
    # the same records under a task that reads Item's own fields say what to do instead
    spec = _spec(
        models,
        tmp_path,
        [{"name": "sums", "file": "sums.jsonl", "task": "gsm8k", "split": {"validation": 2}}],
    )
    code, _, err = _compare(capsys, spec, "--dry-run")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "use task: exact_match" in err and "fields:" in err


@pytest.mark.parametrize(
    "entry, key, words",
    [
        (
            {"task": "regex", "fields": {"prompt": "{x}", "target": "{y}"}},
            "benchmarks[0]",
            "fields.pattern: the regex task needs a pattern",
        ),
        (
            {"task": "exact_match", "fields": {"prompt": "{x}", "choice": "c"}},
            "benchmarks[0]",
            "fields.choice: unknown",
        ),
        (
            {"task": "gsm8k", "fields": {"prompt": "{x}"}},
            "benchmarks[0].fields",
            "only for the generic tasks",
        ),
    ],
)
def test_spec_errors_of_generic_benchmarks(models, tmp_path, entry, key, words):
    from mergelab.compare.spec import SpecError, load_spec

    _write_jsonl(tmp_path / "sums.jsonl", LM_EVAL_RECORDS)
    spec = _spec(models, tmp_path, [{"name": "sums", "file": "sums.jsonl", **entry}])
    with pytest.raises(SpecError) as exc:
        load_spec(spec)
    assert f"{spec}: {key}: " in str(exc.value) and words in str(exc.value)


def test_generic_tasks_are_in_the_one_registry():
    from mergelab.eval import task_origins

    origins = task_origins()
    assert all(origins[t] == "builtin" for t in GENERIC_TASKS)
    assert get_task("multiple_choice").continuations is not None
    assert all(get_task(t).continuations is None for t in GENERIC_TASKS[:3])


def test_mergelab_eval_run_with_fields(models, tmp_path, capsys):
    from mergelab import ModelCandidate
    from mergelab.cli import main

    data = _write_jsonl(tmp_path / "sums.jsonl", LM_EVAL_RECORDS)
    out = tmp_path / "out"
    args = [
        "eval",
        "run",
        "--model",
        str(models["root"] / "math"),
        "--benchmark",
        "multiple_choice",
        "--data",
        str(data),
        "--field",
        "prompt={x}",
        "--field",
        "choices=choices",
        "--field",
        "label=label",
        "--cache-dir",
        str(tmp_path / "c"),
        "--out",
        str(out),
    ]
    assert main(args) == 0, capsys.readouterr().err
    items = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    cand = ModelCandidate(models["math"], models["tok"], name="math")
    for it, rec in zip(items, LM_EVAL_RECORDS):
        lls = cand.score([rec["x"]] * 4, [" " + c for c in rec["choices"]])
        best = max(range(4), key=lambda i: (lls[i], -i))
        assert it["scores"]["acc"] == float(best == rec["label"])
    bad = [
        "eval",
        "run",
        "--model",
        str(models["root"] / "math"),
        "--benchmark",
        "gsm8k",
        "--data",
        str(data),
        "--field",
        "prompt={x}",
    ]
    assert main(bad) == 2
    assert "takes no option 'fields'" in capsys.readouterr().err


def test_few_shot_exemplars_precede_the_prompt(tmp_path):
    from mergelab.eval.prompts import PromptConfig, build_prompt

    path = _write_jsonl(tmp_path / "sums.jsonl", LM_EVAL_RECORDS)
    bench = load_generic(path, task="exact_match", fields={"prompt": "{x}>", "target": "y"})
    config = PromptConfig(n_shots=1, exemplars=({"prompt": "0 plus 0 is>", "target": "0"},))
    assert build_prompt(bench.items[0], bench, config) == "0 plus 0 is>0\n\n1 plus 2 is>"
    mc = load_generic(path, task="multiple_choice", fields={"prompt": "{x}"})
    assert build_prompt(mc.items[0], mc, config) == "0 plus 0 is> 0\n\n1 plus 2 is"


def test_executor_ray_from_the_command_line_keeps_the_specs_cluster_settings(models, tmp_path):
    from mergelab.compare.spec import load_spec, with_executor

    _write_jsonl(tmp_path / "sums.jsonl", LM_EVAL_RECORDS)
    path = _spec(
        models,
        tmp_path,
        [
            {
                "name": "s",
                "file": "sums.jsonl",
                "task": "exact_match",
                "fields": {"prompt": "{x}", "target": "y"},
                "split": {"validation": 2},
            }
        ],
    )
    spec = yaml.safe_load(path.read_text())
    spec["executor"] = {
        "kind": "ray",
        "address": "auto",
        "num_gpus": 0.5,
        "num_cpus": 2,
        "resources": {"big_mem": 1},
    }
    path.write_text(yaml.safe_dump(spec))
    loaded = load_spec(path)
    ray = with_executor(loaded, "ray")
    assert ray.executor == loaded.executor and ray.executor["num_gpus"] == 0.5
    moved = with_executor(loaded, {"kind": "ray", "address": "ray://head:10001"})
    assert moved.executor == {**loaded.executor, "address": "ray://head:10001"}
    assert with_executor(loaded, "local").executor["kind"] == "local"


def test_code_with_tests_from_your_own_records(tmp_path):
    from dataclasses import replace

    recs = [
        {
            "name": "add",
            "stub": "def add(a, b):\n",
            "checks": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"],
        },
        {"name": "neg", "stub": "def neg(a):\n", "checks": "assert neg(2) == -2"},
    ]
    path = _write_jsonl(tmp_path / "code.jsonl", recs)
    fields = {"id": "name", "prompt": "{stub}", "tests": "checks", "entry_point": "name"}
    bench = load_generic(path, task="code_tests", fields=fields)
    assert bench.items[0].tests.asserts == tuple(recs[0]["checks"])
    assert bench.items[1].tests.asserts == (recs[1]["checks"],)
    settings = replace(EvalSettings(), isolation="weak")
    right = {"add": "    return a + b\n", "neg": "    return -a\n"}
    wrong = {"add": "    return a - b\n", "neg": "    return -a\n"}
    assert score_completions(bench, right, settings) == {"add": True, "neg": True}
    assert score_completions(bench, wrong, settings) == {"add": False, "neg": True}
    with pytest.raises(ValueError, match="fields.entry_point: the code_tests task needs it"):
        load_generic(path, task="code_tests", fields={"prompt": "{stub}", "tests": "checks"})
    with pytest.raises(ValueError, match="fields.tests: only for the code_tests task"):
        load_generic(path, task="exact_match", fields={"prompt": "{stub}", "tests": "checks"})
