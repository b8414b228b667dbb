"""A composition saved and loaded as transformers saves a model: `save_pretrained` writes a small
folder naming each component's folder and the formula (no weights), `from_pretrained` gives the
same decoder back; `mergelab compose --save` writes it; `mergelab eval run --model`, `compare`
and the lm-eval bridge take it as a candidate."""

import copy
import json
import os
import string
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from mergelab.candidate import GenerationSettings
from mergelab.cli import main
from mergelab.compose import ComposedDecoder
from mergelab.compose.composed import COMPOSITION_FILE, CompositionConfig
from mergelab.compose.formula import Composition
from mergelab.tiny import char_tokenizer, tiny_causal_lm

PROMPTS = ["hello", "ab", "the cat"]
SETTINGS = GenerationSettings(max_new_tokens=8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tok = char_tokenizer(string.printable)  # benchmark text has capitals and punctuation
    paths = {}
    for i, name in enumerate(["base", "math", "code"]):
        model = tiny_causal_lm(len(tok), seed=i, initializer_range=0.3, max_positions=1024)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        paths[name] = root / name
    torch.manual_seed(3)
    lora = get_peft_model(
        copy.deepcopy(tiny_causal_lm(len(tok), seed=0, initializer_range=0.3, max_positions=1024)),
        LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False),
    )
    lora.save_pretrained(root / "lora")
    paths["lora"] = root / "lora"
    return paths, tok


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path).eval()


def test_save_and_load_give_the_same_decoder(folders, tmp_path):
    paths, tok = folders
    comp = Composition.dexperts("base", "math", "code", 1.5)
    decoder = ComposedDecoder.from_models(
        {n: _load(paths[n]) for n in ("base", "math", "code")}, comp, tok, eos_policy="max"
    )
    out = decoder.save_pretrained(tmp_path / "dexperts")
    files = sorted(p.name for p in out.iterdir())
    assert COMPOSITION_FILE in files and "generation_config.json" in files
    assert not any(f.endswith(".safetensors") for f in files)  # no weights copied
    raw = json.loads((out / COMPOSITION_FILE).read_text())
    assert raw["formula"] == str(comp)
    assert raw["models"] == {n: str(paths[n].resolve()) for n in ("base", "math", "code")}
    again = ComposedDecoder.from_pretrained(out)
    assert again.composition == comp and again.eos_policy == "max"
    assert raw["tokenizer"] == "."  # a tokenizer not read from a folder is saved with it
    assert again.config.to_dict() == {**decoder.config.to_dict(), "tokenizer": str(out.resolve())}
    assert [g.token_ids for g in again.generate(PROMPTS, SETTINGS)] == [
        g.token_ids for g in decoder.generate(PROMPTS, SETTINGS)
    ]
    # nothing overwritten without force; with force, a folder mergelab wrote is replaced
    with pytest.raises(FileExistsError):
        decoder.save_pretrained(out)
    decoder.save_pretrained(out, force=True)


def test_models_not_loaded_from_folders_are_refused_unless_saved(folders, tmp_path):
    _, tok = folders
    live = ComposedDecoder(
        tiny_causal_lm(len(tok), seed=0), [tiny_causal_lm(len(tok), seed=1)], tok
    )
    with pytest.raises(ValueError, match=r"\['base', 'expert1'\] were not loaded from a folder"):
        live.save_pretrained(tmp_path / "live")
    out = live.save_pretrained(tmp_path / "live", save_models=True)
    assert (out / "models" / "base" / "config.json").is_file()
    again = ComposedDecoder.from_pretrained(out)
    assert [g.token_ids for g in again.generate(PROMPTS, SETTINGS)] == [
        g.token_ids for g in live.generate(PROMPTS, SETTINGS)
    ]


def test_lora_composition_round_trips(folders, tmp_path):
    paths, tok = folders
    decoder = ComposedDecoder.from_lora(
        _load(paths["base"]), [paths["lora"]], tok, [0.5], expert_names=["lora"]
    )
    out = decoder.save_pretrained(tmp_path / "lora-comp")
    raw = json.loads((out / COMPOSITION_FILE).read_text())
    assert raw["adapters"] == {"lora": str(paths["lora"].resolve())}
    again = ComposedDecoder.from_pretrained(out)
    assert [g.token_ids for g in again.generate(PROMPTS, SETTINGS)] == [
        g.token_ids for g in decoder.generate(PROMPTS, SETTINGS)
    ]


def test_a_broken_composition_file_is_one_line(folders, tmp_path):
    paths, _ = folders
    folder = tmp_path / "hand"
    folder.mkdir()
    comp = Composition.weighted("base", ["math"])
    (folder / COMPOSITION_FILE).write_text(
        json.dumps({"composition": comp.to_dict(), "models": {"base": str(paths["base"])}})
    )
    with pytest.raises(ValueError, match="names \\['base', 'math'\\]; models and adapters give"):
        CompositionConfig.from_file(folder)
    # relative paths are read against the folder
    relative = os.path.relpath(paths["base"], folder)
    raw = {"composition": comp.to_dict(), "models": {"base": relative, "math": str(paths["math"])}}
    (folder / COMPOSITION_FILE).write_text(json.dumps(raw))
    read = CompositionConfig.from_file(folder)
    assert Path(read.models["base"]).resolve() == paths["base"].resolve()
    (folder / COMPOSITION_FILE).write_text(json.dumps({**raw, "colour": 1}))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['colour'\]"):
        CompositionConfig.from_file(folder)


def test_compose_cli_saves_the_composition(folders, tmp_path, capsys):
    paths, tok = folders
    out = tmp_path / "saved"
    argv = [
        "compose",
        "--base",
        str(paths["base"]),
        "--expert",
        str(paths["math"]),
        "--expert",
        str(paths["code"]),
        "--expert-name",
        "math",
        "--expert-name",
        "code",
        "--weight",
        "1",
        "--weight",
        "0.5",
        "--save",
        str(out),
    ]
    assert main(argv) == 0
    decoder = ComposedDecoder.from_pretrained(out)
    assert str(decoder.composition) == "base + 1.0·(math − base) + 0.5·(code − base)"
    assert main(argv) == 2  # exists: not replaced without --force
    assert "already exists" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0
    # an adapter folder given without --lora is named as such
    bad = ["compose", "--base", str(paths["base"]), "--expert", str(paths["lora"]), "--prompt", "x"]
    assert main(bad) == 2
    assert (
        "is a PEFT LoRA adapter folder (adapter_config.json); pass --lora"
        in capsys.readouterr().err
    )


def test_eval_run_and_the_lm_eval_bridge_take_the_folder(folders, tmp_path):
    """`mergelab eval run --model DIR` and the lm-eval bridge (`spec=DIR`) load a saved
    composition as the composition itself: the same generations and log-likelihoods."""
    from mergelab.eval.lm_eval_bridge import MergelabLM
    from mergelab.eval.spec import build_candidate

    paths, tok = folders
    decoder = ComposedDecoder(
        _load(paths["base"]), [_load(paths["math"]), _load(paths["code"])], tok, [1.0, 0.5]
    )
    saved = decoder.save_pretrained(tmp_path / "comp")
    built = build_candidate(saved, dtype="float32")
    assert isinstance(built, ComposedDecoder) and built.composition == decoder.composition
    bridge = MergelabLM(spec=str(saved), device="cpu")
    assert bridge.candidate.score(PROMPTS, ["xy", "z", "abc"]) == pytest.approx(
        decoder.score(PROMPTS, ["xy", "z", "abc"]), abs=1e-5
    )
    fixtures = Path(__file__).resolve().parent / "fixtures" / "eval"
    argv = [
        "eval",
        "run",
        "--model",
        str(saved),
        "--benchmark",
        "gsm8k",
        "--data",
        str(fixtures / "gsm8k.jsonl"),
        "--max-new-tokens",
        "3",
        "--n-shots",
        "0",
        "--limit",
        "2",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["candidate"]["type"] == "ComposedDecoder"
    assert summary["candidate"]["composition"] == decoder.composition.to_dict()
