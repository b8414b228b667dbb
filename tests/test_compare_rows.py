"""Every row of a comparison says what it is made of (table, results.json, --dry-run); mixed
full and LoRA experts are listed explicitly or refused with a line that says how; a composition
saved by `mergelab compose --save` is a row of its own."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import mergelab.compare as mc
from mergelab.cli import main
from mergelab.tiny import char_tokenizer, tiny_llama

GEN = {"max_new_tokens": 4, "batch_size": 8}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("rows")
    tok = char_tokenizer("0123456789 \n", bos=None, unk="<unk>", padding_side="left")
    for i, name in enumerate(("base", "math", "code")):
        model = tiny_llama(tok, hidden_size=32, num_layers=1, seed=i, initializer_range=0.3)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    base = tiny_llama(tok, hidden_size=32, num_layers=1, seed=0, initializer_range=0.3)
    lora = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.copy_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    lora.save_pretrained(root / "style")
    lora.merge_and_unload().save_pretrained(root / "style_full")  # the base with it merged in
    with open(root / "arith.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"item_id": f"q{i}", "prompt": f"{i} {i}", "answer": str(i)}))
            f.write("\n")
    return root


def _spec(root, candidates, experts=("math", "code", "style")):
    kinds = {"math": str(root / "math"), "code": str(root / "code")}
    kinds["style"] = {"adapter": str(root / "style")}
    kinds["style_full"] = str(root / "style_full")
    return {
        "name": "rows",
        "models": {"base": str(root / "base"), "experts": {e: kinds[e] for e in experts}},
        "candidates": candidates,
        "benchmarks": [
            {
                "name": "arith",
                "file": str(root / "arith.jsonl"),
                "task": "gsm8k",
                "split": {"test": "rest"},
                "generation": GEN,
                "prompt": {"n_shots": 0},
                "baselines": [],
            }
        ],
        "statistics": {"bootstrap_samples": 100},
    }


@pytest.mark.parametrize(
    "family, words",
    [
        ({"family": "composition"}, "list this composition family's experts — ['math', 'code']"),
        ({"family": "merge", "method": "linear"}, "adapter merged in"),
        ({"family": "lora_composition"}, "a lora_ family takes adapters only"),
    ],
)
def test_mixed_experts_without_a_list_are_refused_saying_how(world, family, words):
    with pytest.raises(mc.SpecError, match="mixes full models") as info:
        mc.parse_spec(_spec(world, [{"family": "base"}, family]), source="s.yaml")
    assert words in str(info.value) and "candidates[1].experts" in str(info.value)
    assert "\n" not in str(info.value)


def test_rows_list_their_models_and_parameters(world, tmp_path):
    spec = _spec(
        world,
        [
            {"family": "base"},
            {"family": "expert", "experts": ["math", "style"], "best_expert": False},
            {"family": "composition", "experts": ["math", "style"], "weights": [1.0, 0.5]},
            {
                "family": "merge",
                "method": "ties",
                "experts": ["math", "code"],
                "params": {"density": 0.5},
                "weights": [1.0, 0.5],
            },
            {"family": "lora_composition", "experts": ["style"]},
            {
                "family": "composition",
                "name": "explicit",
                "experts": ["math", "style_full"],
                "weights": [1.0, 0.5],
            },
        ],
        experts=("math", "code", "style", "style_full"),
    )
    plan = mc.make_plan(mc.parse_spec(spec, source="s.yaml"))
    text = plan.describe()
    assert "style: style (LoRA adapter merged into the base)" in text
    assert (
        "made of: base, math, style (LoRA adapter merged into the base); "
        "base + 1.0·(math − base) + 0.5·(style − base)"
    ) in text
    assert "made of: base, math, code; ties; params density=0.5; weights [1.0, 0.5]" in text
    assert "made of: base, style (LoRA adapter (ΔW)); base + 1.0·(style − base)" in text
    res = mc.run(spec, tmp_path / "out", progress=False, figures=False)
    rows = {r["row"]: r["made_of"] for r in res["rows"]}
    assert rows["composition"]["models"] == {
        "base": "model",
        "math": "model",
        "style": "LoRA adapter merged into the base",
    }
    assert rows["ties"] == {
        "models": {"base": "model", "math": "model", "code": "model"},
        "method": "ties",
        "params": {"density": 0.5},
        "weights": [1.0, 0.5],
    }
    table = (tmp_path / "out" / "table.md").read_text()
    assert "What each row is made of:" in table
    assert "- lora_composition: base, style (LoRA adapter (ΔW)); base + 1.0·(style − base)" in table
    # the adapter merged in: the same outputs as the base-plus-adapter model saved in full
    by_row = {r["row"]: r for r in res["runs"]}
    assert by_row["explicit"]["completions_sha256"] == by_row["composition"]["completions_sha256"]


def test_a_saved_composition_is_a_row(world, tmp_path, capsys):
    saved = tmp_path / "math-code"
    argv = [
        "compose",
        "--base",
        str(world / "base"),
        "--expert",
        str(world / "math"),
        "--expert",
        str(world / "code"),
        "--expert-name",
        "math",
        "--expert-name",
        "code",
        "--weight",
        "1",
        "--weight",
        "0.5",
        "--save",
        str(saved),
    ]
    assert main(argv) == 0
    spec = _spec(
        world,
        [
            {"family": "composition", "experts": ["math", "code"], "weights": [1.0, 0.5]},
            {"family": "composition", "name": "saved", "path": str(saved)},
        ],
        experts=("math", "code"),
    )
    res = mc.run(spec, tmp_path / "out", progress=False, figures=False)
    by_row = {r["row"]: r for r in res["runs"]}
    assert by_row["saved"]["completions_sha256"] == by_row["composition"]["completions_sha256"]
    made = {r["row"]: r["made_of"] for r in res["rows"]}["saved"]
    assert made["formula"] == "base + 1.0·(math − base) + 0.5·(code − base)"
    assert made["saved"] == str(saved)
    bad = _spec(world, [{"family": "composition", "path": str(saved), "weights": [1, 1]}])
    with pytest.raises(mc.SpecError, match=r"candidates\[0\].weights: a saved composition"):
        mc.parse_spec(bad, source="s.yaml")


def test_progress_shows_in_a_log_as_lines(world, tmp_path, capfd):
    """`mergelab compare` with stderr not a terminal (as under nohup or SLURM): plain job
    lines, and no bars (transformers' "Loading weights" included)."""
    import yaml
    from transformers.utils import logging as hf_logging

    spec = _spec(
        world,
        [{"family": "base"}, {"family": "composition", "experts": ["math", "code"]}],
        experts=("math", "code"),
    )
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    try:
        assert main(["compare", str(path), "--out", str(tmp_path / "out")]) == 0
    finally:
        hf_logging.enable_progress_bar()  # the command turned them off for this process
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("test (seed 0)")]
    assert lines[0] == "test (seed 0): 0/2 jobs (0%), elapsed 0s"
    assert lines[-1].startswith("test (seed 0): 2/2 jobs (100%), ")
    assert "\r" not in err
