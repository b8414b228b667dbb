"""lm-eval tasks in `mergelab compare` (``lm_eval: {task, include_path}``) and through
:func:`mergelab.eval.evaluate`: lm-eval scores every candidate with its own prompts and metrics,
per document, so the paired statistics and McNemar apply. Offline: a local task YAML over a
local JSONL file, tiny models built from configs.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from _reference import require

lm_eval = require("lm_eval")

from mergelab.eval import EvalSettings, evaluate  # noqa: E402
from mergelab.eval.lm_eval_tasks import load_lm_eval_task  # noqa: E402

TASK = "mergelab_own_mc"
DOCS = [
    {"question": f"{a} plus {b} is", "choices": [f" {a + b + d}" for d in (0, 1, -1)], "answer": 0}
    for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (7, 1), (4, 4), (6, 3), (0, 5), (2, 7), (3, 3)]
]


def _task_folder(root: Path) -> Path:
    """A multiple-choice task YAML whose data file is given by absolute path."""
    folder = root / "tasks"
    folder.mkdir()
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    config = {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "target_delimiter": "",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }
    (folder / f"{TASK}.yaml").write_text(yaml.safe_dump(config))
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from mergelab.tiny import char_tokenizer, tiny_llama

    tok = char_tokenizer("0123456789 abcdefghijklmnopqrstuvwxyz", bos=None, unk="<unk>")
    root = tmp_path_factory.mktemp("lm_eval_compare")
    models = {}
    for i, name in enumerate(("base", "math", "code")):
        m = tiny_llama(tok, hidden_size=32, num_layers=2, seed=0, initializer_range=0.3)
        if i:
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        models[name] = m
    return {"tok": tok, "root": root, "tasks": _task_folder(root), **models}


def test_per_item_scores_are_lm_evals_own_per_document_metrics(world, tmp_path):
    from lm_eval.tasks import TaskManager

    from mergelab import ModelCandidate
    from mergelab.eval.lm_eval_bridge import MergelabLM

    cand = ModelCandidate(world["math"], world["tok"], name="math")
    bench = load_lm_eval_task({"task": TASK, "include_path": str(world["tasks"])})
    assert [it.item_id for it in bench.items] == [str(i) for i in range(len(DOCS))]
    assert bench.items[3].prompt == DOCS[3]["question"]
    # a subset (as a compare split is: its items in a random order) scores each document as
    # lm-eval's full run does
    items = [bench.items[i] for i in (7, 2, 5, 3, 6, 4)]
    subset = type(bench)(bench.name, bench.task, items, bench.source)
    result = evaluate(cand, subset, EvalSettings(), cache_dir=tmp_path / "c", progress=False)
    full = lm_eval.simple_evaluate(
        model=MergelabLM(cand),
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(world["tasks"]), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    by_doc = {str(s["doc_id"]): s for s in full["samples"][TASK]}
    assert result.primary_metric == "acc"
    for item in result.items:
        doc = by_doc[item["item_id"]]
        assert item["scores"] == {"acc": doc["acc"], "acc_norm": doc["acc_norm"]}
        # the document's own log-likelihoods (0/1 scores alone could match by chance)
        ours = json.loads(item["samples"][0]["text"])
        assert [ll for ll, _ in ours] == pytest.approx([ll for ll, _ in doc["filtered_resps"]])
    values = [it["scores"]["acc"] for it in result.items]
    assert result.score() == pytest.approx(sum(values) / len(values))
    again = evaluate(cand, subset, EvalSettings(), cache_dir=tmp_path / "c", progress=False)
    assert again.summary["generated_this_call"] == 0 and again.items == result.items


def _spec(world, tmp_path: Path, lm_eval_entry) -> Path:
    root = world["root"]
    spec = {
        "name": "lm-eval-in-compare",
        "models": {
            "base": str(root / "base"),
            "experts": {"math": str(root / "math"), "code": str(root / "code")},
        },
        "candidates": [
            {"family": "base"},
            {"family": "expert"},
            {"family": "merge", "method": "task_arithmetic", "grid": {"lambda": [0.5, 1.0]}},
        ],
        "benchmarks": [
            {"name": "sums", "lm_eval": lm_eval_entry, "split": {"validation": 4, "test": "rest"}}
        ],
        "statistics": {"bootstrap_samples": 200},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_compare_runs_an_lm_eval_task_with_paired_statistics(world, tmp_path, capsys):
    from mergelab.cli import main

    spec_dir = tmp_path / "specs"
    spec_dir.mkdir()
    relative = os.path.relpath(world["tasks"], spec_dir)  # read from the spec file's folder
    spec = _spec(world, spec_dir, {"task": TASK, "include_path": relative})
    assert main(["compare", str(spec), "--dry-run"]) == 0
    assert "lm_eval" in capsys.readouterr().out
    out = tmp_path / "out"
    code = main(["compare", str(spec), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    # Progress in a log (stderr is not a terminal here): the job lines, as for any benchmark;
    # none of lm-eval's bars, whose carriage returns a log shows as garbled lines.
    assert "\r" not in err and "Tokenizing inputs" not in err, err[-2000:]
    assert "test (seed 0): 4/4 jobs (100%)" in err
    results = json.loads((out / "results.json").read_text())
    tests = [r for r in results["runs"] if r["split"] == "test"]
    assert len(tests) == 4 and all(r["metric"] == "acc" for r in tests)
    assert all(len(r["items"]) == 6 and set(r["items"].values()) <= {0.0, 1.0} for r in tests)
    pair = results["statistics"]["per_seed"]["0"]["sums"]["pairwise"]["base vs math"]
    base = next(r for r in tests if r["row"] == "base")["items"]
    math = next(r for r in tests if r["row"] == "math")["items"]
    assert pair["n"] == 6
    assert pair["mcnemar"]["a_only"] == sum(base[i] > math[i] for i in base)
    assert pair["mcnemar"]["b_only"] == sum(base[i] < math[i] for i in base)
    # Cost, as the bridge measured it: lm-eval's loglikelihood requests score every choice's
    # continuation (one token per character with this tokenizer); the time is the model's.
    for r in tests:
        scored = [sum(len(c) for c in DOCS[int(i)]["choices"]) for i in r["items"]]
        assert r["cost"]["tokens_counted"] == "scored"
        assert r["cost"]["tokens_per_item"] == pytest.approx(sum(scored) / len(scored))
        assert r["cost"]["ms_per_token"] > 0 and r["cost"]["mean_new_tokens"] == 0
    assert results["costs"]["base"]["sums"]["tokens_counted"] == "scored"
    table = (out / "table.md").read_text()
    assert "| model evals/token | scored tokens/item | ms/scored token |" in table


@pytest.mark.parametrize(
    "entry, words",
    [
        ({"task": "no_such_task"}, "no lm-eval task 'no_such_task' in"),
        ({"task": TASK, "metric": "f1"}, "reports acc, acc_norm; 'f1' is not one of them"),
        ({"task": TASK, "num_fewshot": -1}, "lm_eval.num_fewshot: expected an integer ≥ 0"),
        ({"task": TASK, "fewshot": 2}, "lm_eval.fewshot: unknown"),
    ],
)
def test_lm_eval_entry_errors_are_one_line_at_dry_run(world, tmp_path, capsys, entry, words):
    from mergelab.cli import main

    spec = _spec(world, tmp_path, {"include_path": str(world["tasks"]), **entry})
    assert main(["compare", str(spec), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "benchmarks[" in err, err


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "where, relation",
    [
        (lambda tasks, tmp: ["--out", str(tasks / "out")], "the output folder"),
        (lambda tasks, tmp: ["--out", str(tasks)], "is the task folder"),
        (lambda tasks, tmp: ["--out", str(tasks.parent)], "contains the task folder"),
        (
            lambda tasks, tmp: ["--out", str(tmp / "o"), "--cache", str(tasks / "c")],
            "the cache folder",
        ),
        (lambda tasks, tmp: ["--out", str(tmp / "o"), "--cache", str(tasks)], "the cache folder"),
    ],
)
@pytest.mark.parametrize("dry_run", [True, False])
def test_out_or_cache_overlapping_an_include_path_is_refused_before_any_work(
    world, tmp_path, capsys, where, relation, dry_run
):
    """lm-eval reads every YAML under include_path, and --force would replace what is there:
    an output or cache that is, holds or sits inside it is refused in one line, exit 2, at
    --dry-run and at the start of a run, with nothing written."""
    from mergelab.cli import main

    tasks = tmp_path / "proj" / "tasks"
    tasks.mkdir(parents=True)
    for f in world["tasks"].iterdir():
        (tasks / f.name).write_bytes(f.read_bytes())
    spec = _spec(world, tmp_path, {"task": TASK, "include_path": str(tasks)})
    before = _tree(tmp_path)
    argv = ["compare", str(spec), *where(tasks, tmp_path), "--no-progress"]
    assert main(argv + (["--dry-run"] if dry_run else [])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "benchmarks[sums].lm_eval.include_path" in err and relation in err, err
    assert str(tasks) in err
    assert _tree(tmp_path) == before  # nothing written, nothing of the user's touched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proj", "spec.yaml"]


def test_run_from_python_refuses_a_cache_inside_an_include_path(world, tmp_path):
    from mergelab.compare import run
    from mergelab.compare.spec import SpecError

    spec = _spec(world, tmp_path, {"task": TASK, "include_path": str(world["tasks"])})
    with pytest.raises(SpecError, match="the cache folder .* is inside the task folder"):
        run(str(spec), cache_dir=world["tasks"] / "cache")
    assert not (world["tasks"] / "cache").exists()


class _Stream(io.StringIO):
    def __init__(self, terminal: bool):
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


@pytest.mark.parametrize("terminal", [True, False])
def test_lm_evals_progress_is_bars_on_a_terminal_and_lines_in_a_log(world, monkeypatch, terminal):
    """On a terminal lm-eval's bars and the bridge's (tqdm) are drawn, as before; in a log the
    bridge's request progress is mergelab.progress's plain lines and lm-eval's own bars are off
    (no carriage returns); with progress off, nothing."""
    from mergelab import ModelCandidate
    from mergelab.eval.lm_eval_tasks import run_lm_eval

    cand = ModelCandidate(world["math"], world["tok"], name="math")
    bench = load_lm_eval_task({"task": TASK, "include_path": str(world["tasks"])})
    items = [bench.items[i] for i in (4, 1, 8)]
    stream = _Stream(terminal)
    monkeypatch.setattr("sys.stderr", stream)
    records = run_lm_eval(cand, items, progress=True)
    text = stream.getvalue()
    assert "loglikelihood (mergelab)" in text
    if terminal:
        assert "\r" in text and "Tokenizing inputs" in text and "9/9" in text
    else:
        assert "\r" not in text and "Tokenizing inputs" not in text and "%|" not in text
        lines = [line for line in text.splitlines() if "(mergelab)" in line]
        assert lines[0] == "loglikelihood (mergelab): 0/9 requests (0%), elapsed 0s"
        assert lines[-1].startswith("loglikelihood (mergelab): 9/9 requests (100%)")
    quiet = _Stream(terminal)
    monkeypatch.setattr("sys.stderr", quiet)
    assert run_lm_eval(cand, items, progress=False).keys() == records.keys()
    assert "(mergelab)" not in quiet.getvalue() and "\r" not in quiet.getvalue()
