"""Merge configs in two dialects, never mixed: mergelab's (``method``, the papers' defaults) and
mergekit's (``merge_method``, mergekit 0.1.5's semantics). ``--explain`` for both; every refusal
with its message; hub names from the local Hugging Face cache only; the model card.

(That mergekit-dialect configs give mergekit's model is tests/test_merge_mergekit_configs.py.)
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import yaml

from mergelab.cli import main
from mergelab.tiny import tiny_llama

WORDS = [f"w{i}" for i in range(60)]


def tiny_tokenizer(words: list[str]):
    """A word-level fast tokenizer: 4 special tokens, then ``words``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["[UNK]", "[PAD]", "<s>", "</s>", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="<s>",
        eos_token="</s>",
    )


def write_model(
    folder: Path, family: str, noise: float, *, vocab_words=WORDS, dtype=None, layers: int = 4
):
    """A tiny Llama: the family's seeded weights plus seeded noise of size ``noise``."""
    model = tiny_llama(
        4 + len(vocab_words),
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        num_key_value_heads=2,
        max_positions=2048,
        seed=zlib.crc32(family.encode()),
        pad_token_id=None,
        eos_token_id=2,
        bos_token_id=1,  # LlamaConfig's defaults
    )
    g = torch.Generator().manual_seed(zlib.crc32(str(folder.name).encode()) + int(noise * 1e4))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    tiny_tokenizer(vocab_words).save_pretrained(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """base, a, b, c: tiny related 4-layer Llamas; short: a 2-layer one; wide: 66 tokens."""
    root = tmp_path_factory.mktemp("models")
    for name, noise in (("base", 0.0), ("a", 0.02), ("b", 0.01), ("c", 0.03)):
        write_model(root / name, "llama", noise)
    return root


def write(folder: Path, text: str, name: str = "merge.yml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def explain(config: Path, capsys, *extra: str) -> str:
    assert main(["merge", "--config", str(config), "--explain", *extra]) == 0
    return capsys.readouterr().out


TIES = """\
models:
  - model: a
    parameters: {density: [1, 0.7, 0.1], weight: 1.0}
  - model: b
    parameters:
      density: 0.5
      weight: [{filter: mlp, value: 0.5}, {value: 0}]
base_model: base
parameters: {normalize: true, int8_mask: true}
"""


# --- two dialects --------------------------------------------------------------------------


def test_the_method_key_decides_the_semantics(models, capsys):
    """One TIES config, spelled two ways. mergekit's spelling gets mergekit's
    per-tensor trim, weighted sign and weight-sum normalisation (density default 1.0);
    mergelab's keeps the paper's whole-model trim, unweighted sign and division by count."""
    theirs = explain(write(models, "merge_method: ties\n" + TIES + "dtype: float16\n"), capsys)
    assert "dialect: mergekit" in theirs
    assert "trim_scope=tensor majority_sign=sum weighted_sign=true divide_by=weight_sum" in theirs
    assert "dtype: inputs float16, compute float16, output float16" in theirs
    ours = "method: ties\nbase: base\nmodels: [{model: a, parameters: {weight: 1.0}}, b]\n"
    text = explain(write(models, ours + "dtype: float16\n"), capsys)
    assert "dialect: mergelab" in text
    assert 'trim_scope="model"' in text and 'divide_by="count"' in text
    assert '"weighted_sign": false' not in text and "weighted_sign=false" in text
    assert "density=[0.2, 0.2]" in text  # the paper's k, not mergekit's 1.0
    assert "compute float16, output float32" in text  # mergelab: dtype is the compute dtype


def test_explain_prints_parameters_per_layer_and_filter_match(models, capsys):
    """A gradient gives each layer its own values (t = i/(n-1) over 4 layers); a filter splits
    a layer's tensors; tensors outside the layers use t = 0."""
    text = explain(write(models, "merge_method: ties\n" + TIES), capsys)
    assert "tensors: 39 in" in text
    lines = text.splitlines()
    mlp1 = lines.index(
        "model.layers.1.{mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight}"
    )
    assert lines[mlp1 + 1] == "  inputs: base=base, a, b; t = 0.333333"
    assert "weight=[a: 1, b: 0.5] density=[a: 0.8, b: 0.5]" in lines[mlp1 + 2]
    assert lines[mlp1 + 3].startswith("  computed: ties lambda=1 trim_scope=tensor")
    attn1 = next(i for i, line in enumerate(lines) if line.startswith("model.layers.1.{post_att"))
    assert "weight=[a: 1, b: 0]" in lines[attn1 + 2]  # the filter's fallback value
    head = next(i for i, line in enumerate(lines) if line.startswith("lm_head.weight"))
    assert "t = 0" in lines[head + 1] and "density=[a: 1, b: 0.5]" in lines[head + 2]
    assert "note: int8_mask changes only mergekit's memory use, not the result" in text
    assert not (models / "merged").exists()


def test_explain_shows_stacked_layers_and_their_sources(models, capsys):
    config = """\
slices:
  - sources: [{model: a, layer_range: [0, 3]}]
  - sources: [{model: b, layer_range: [1, 4]}]
merge_method: passthrough
"""
    text = explain(write(models, config), capsys)
    assert "model.layers.3.{" in text and "inputs: b (layer 1); t = 0" in text
    assert "model.layers.5.{" in text and "inputs: b (layer 3); t = 1" in text
    assert main(["merge", "--config", str(models / "merge.yml"), "--dry-run"]) == 0
    assert 'config.json: {"num_hidden_layers": 6}' in capsys.readouterr().out


# --- refusals, each with its message -------------------------------------------------------

REFUSALS = {
    "mixed-1": ("method: ties\nbase_model: base\nmodels: [a]\n", "mixes dialects"),
    "mixed-2": ("merge_method: ties\nbase: base\nmodels: [{model: a}]\n", "mixes dialects"),
    "both-keys": ("method: ties\nmerge_method: ties\nmodels: [a]\n", "gives both 'method'"),
    "unknown-method": (
        "merge_method: tie\nmodels: [{model: a}]\n",
        "merge_method 'tie' is not one of mergekit 0.1.5's methods",
    ),
    "breadcrumbs_ties": (
        "merge_method: breadcrumbs_ties\nbase_model: base\nmodels: [{model: a}]\n",
        "breadcrumbs_ties (Breadcrumbs' mask followed by TIES' sign election) has no mergelab",
    ),
    "ram": ("merge_method: ram\nmodels: [{model: a}]\n", "ram (reinforced agent merging)"),
    "modules": (
        "merge_method: linear\nmodules: {text: {models: [{model: a}]}}\n",
        "'modules' (per-module merges of multi-module models) is not supported",
    ),
    "residual_weight": (
        "merge_method: passthrough\nslices:\n  - sources: [{model: a, layer_range: [0, 2]}]\n"
        "    residual_weight: 0.5\n",
        "residual_weight is accepted but ignored by mergekit 0.1.5; mergelab refuses it",
    ),
    "lora-reference": (
        "merge_method: linear\nmodels: [{model: a+adapter, parameters: {weight: 1}}]\n",
        "'a+adapter' is mergekit's model+LoRA reference, which mergelab does not support",
    ),
    "model-mapping": (
        "merge_method: linear\nmodels: [{model: {model: a, lora: x}}]\n",
        "a model given as a mapping",
    ),
    "two-tokenizers": (
        "merge_method: linear\nmodels: [{model: a}]\ntokenizer_source: base\n"
        "tokenizer: {source: union}\n",
        "give tokenizer_source or tokenizer, not both",
    ),
    "ties-rescale": (
        "merge_method: ties\nbase_model: base\nmodels: [{model: a, parameters: {weight: 1}}]\n"
        "parameters: {rescale: true}\n",
        "rescale: true with ties (rescaling a magnitude-trimmed task vector to its L1 norm) "
        "is not supported",
    ),
    "missing-weight": (
        "merge_method: ties\nbase_model: base\nmodels: [{model: a}]\n",
        "missing required parameter weight for model a, tensor model.embed_tokens.weight",
    ),
    "unknown-parameter": (
        "merge_method: ties\nbase_model: base\nmodels: [{model: a, parameters: {desnity: 0.5}}]\n",
        "models[0].parameters: 'desnity' is not a parameter of mergekit's ties",
    ),
    "filter-key": (
        "merge_method: slerp\nbase_model: base\nmodels: [{model: a}, {model: base}]\n"
        "parameters: {t: [{filtr: mlp, value: 0.5}]}\n",
        "parameters.t[0]: unknown key(s) ['filtr']",
    ),
    "mixed-gradient": (
        "merge_method: slerp\nbase_model: base\nmodels: [{model: a}]\n"
        "parameters: {t: [0.5, {value: 1}]}\n",
        "a list must hold only values (a gradient) or only {filter, value} entries",
    ),
    "bool": (
        "merge_method: ties\nbase_model: base\nmodels: [{model: a, parameters: {weight: 1}}]\n"
        "parameters: {normalize: maybe}\n",
        "normalize must be true or false, got 'maybe'",
    ),
    "slice-lengths": (
        "merge_method: slerp\nbase_model: a\nparameters: {t: 0.5}\nslices:\n"
        "  - sources: [{model: a, layer_range: [0, 2]}, {model: b, layer_range: [0, 3]}]\n",
        "every source must contain the same number of layers, got [2, 3]",
    ),
    "layer-range": (
        "merge_method: passthrough\nslices:\n  - sources: [{model: a, layer_range: [2, 6]}]\n",
        "layer_range [2, 6] of a goes past its 4 layers",
    ),
    "slice-base": (
        "merge_method: slerp\nbase_model: base\nparameters: {t: 0.5}\nslices:\n"
        "  - sources: [{model: a, layer_range: [0, 4]}, {model: b, layer_range: [0, 4]}]\n",
        "slices[0]: base_model base is not among the inputs",
    ),
    "no-base": (
        "merge_method: ties\nmodels: [{model: a, parameters: {weight: 1}}]\n",
        "merge_method ties needs a base_model among the inputs",
    ),
    "slerp-count": (
        "merge_method: slerp\nbase_model: base\nmodels: [{model: a}, {model: b}]\n"
        "parameters: {t: 0.5}\n",
        "merge_method slerp takes exactly 2 inputs, got 3",
    ),
    "template-name": (
        "merge_method: linear\nmodels: [{model: a, parameters: {weight: 1}}]\n"
        "chat_template: chatml\n",
        "chat_template 'chatml': mergekit's bundled templates by name are not shipped",
    ),
    "dtype": ("merge_method: linear\nmodels: [{model: a}]\ndtype: int8\n", "dtype: 'int8' is not"),
    "models-and-slices": (
        "merge_method: passthrough\nmodels: [{model: a}]\n"
        "slices: [{sources: [{model: a, layer_range: [0, 1]}]}]\n",
        "give exactly one of 'models' and 'slices'",
    ),
    "hub-name": (
        "merge_method: linear\nmodels: [{model: nobody/no-such-model, parameters: {weight: 1}}]\n",
        "model 'nobody/no-such-model' is not a local folder",
    ),
    "token-kind": (
        "merge_method: linear\nmodels: [{model: a}]\n"
        "tokenizer: {tokens: {x: {source: {kind: mean}}}}\n",
        "tokenizer.tokens['x'].source.kind must be model_token or zero",
    ),
    "density-zero": (
        "merge_method: ties\nbase_model: base\n"
        "models: [{model: a, parameters: {weight: 1, density: 0}}]\n",
        "density of model 0 must lie in (0, 1], got 0",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_what_is_not_supported(models, capsys, case):
    text, message = REFUSALS[case]
    config = write(models, text)
    assert main(["merge", "--config", str(config), "--explain"]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1  # one line


def test_different_layer_counts_need_slices(models, tmp_path, capsys):
    write_model(tmp_path / "short", "llama", 0.01, layers=2)
    text = f"merge_method: linear\nmodels: [{{model: {models / 'a'}}}, {{model: short}}]\n"
    config = write(tmp_path, text + "parameters: {weight: 1}\n")
    assert main(["merge", "--config", str(config), "--explain"]) == 2
    assert "different numbers of layers" in capsys.readouterr().err


def test_flags_that_change_a_mergekit_config_are_refused(models, capsys):
    config = write(models, "merge_method: linear\nmodels: [{model: a}]\nparameters: {weight: 1}\n")
    argv = ["merge", "--config", str(config), "--param", "weight=2", "--explain"]
    assert main(argv) == 2
    assert "--param cannot be combined with a mergekit-dialect config" in capsys.readouterr().err


# --- where models are: local folders first, then the local Hugging Face cache --------------


def fake_hub_cache(root: Path, repo: str, source: Path) -> Path:
    """A Hugging Face cache holding ``repo`` (refs/main -> one snapshot), as the hub writes it."""
    folder = root / "hub" / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0123abcd")
    shutil.copytree(source, folder / "snapshots" / "0123abcd")
    return folder / "snapshots" / "0123abcd"


def test_hub_names_come_from_the_local_cache(models, tmp_path, monkeypatch, capsys):
    snapshot = fake_hub_cache(tmp_path / "hf", "org/tiny", models / "a")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    text = f"merge_method: task_arithmetic\nbase_model: {models / 'base'}\n"
    config = write(tmp_path, text + "models: [{model: org/tiny, parameters: {weight: 0.5}}]\n")
    assert main(["merge", "--config", str(config), "--explain"]) == 0
    assert f"model: org/tiny = {snapshot}" in capsys.readouterr().out
    assert main(["merge", "--config", str(config), "--out", "merged", "--no-progress"]) == 0
    card = (tmp_path / "merged" / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == ["org/tiny"] and "mergelab" in front["tags"]
    # mergelab's dialect and flags look there too
    ours = f"method: linear\nmodels: [org/tiny, {models / 'b'}]\n"
    assert main(["merge", "--config", str(write(tmp_path, ours)), "--explain"]) == 0
    assert f"model 0: {snapshot}" in capsys.readouterr().out
    assert (
        main(["merge", "--method", "linear", "--models", "org/tiny", "org/absent", "--explain"])
        == 2
    )
    assert "'org/absent' is not a local folder" in capsys.readouterr().err


def test_a_local_folder_wins_over_a_hub_name(models, tmp_path, monkeypatch, capsys):
    """org/tiny exists both in the cache and as a folder next to the config: the folder is used.
    A folder of that name next to the config and another in the working folder is ambiguous."""
    fake_hub_cache(tmp_path / "hf", "org/tiny", models / "a")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    shutil.copytree(models / "b", tmp_path / "cfg" / "org" / "tiny")
    text = "merge_method: linear\nmodels: [{model: org/tiny, parameters: {weight: 1}}]\n"
    config = write(tmp_path / "cfg", text)
    monkeypatch.chdir(tmp_path)
    assert main(["merge", "--config", str(config), "--explain"]) == 0
    assert f"model: org/tiny = {tmp_path / 'cfg' / 'org' / 'tiny'}" in capsys.readouterr().out
    shutil.copytree(models / "c", tmp_path / "org" / "tiny")
    assert main(["merge", "--config", str(config), "--explain"]) == 2
    assert "model 'org/tiny' is ambiguous" in capsys.readouterr().err


# --- the model card ------------------------------------------------------------------------


def test_every_merge_gets_a_model_card(models, tmp_path, capsys):
    """README.md beside mergelab_merge.json, listed in the output marker: method, inputs,
    parameters (per group of tensors for mergekit's dialect) and the config as written."""
    out = tmp_path / "ours"
    argv = [
        "merge",
        "--method",
        "ties",
        "--base",
        str(models / "base"),
        "--model",
        f"{models / 'a'}:0.7",
    ]
    assert main([*argv, "--param", "density=0.5", "--out", str(out), "--no-progress"]) == 0
    card = (out / "README.md").read_text()
    assert "`ties`." in card and f"* base: `{models / 'base'}`" in card
    assert "* `density`: [0.5]" in card and "method: ties" in card  # the merge as a config
    marker = json.loads((out / "mergelab_output.json").read_text())
    assert {"README.md", "mergelab_merge.json"} <= set(marker["entries"])

    config = write(models, "merge_method: ties\n" + TIES)
    out = tmp_path / "theirs"
    assert main(["merge", "--config", str(config), "--out", str(out), "--no-progress"]) == 0
    card = (out / "README.md").read_text()
    assert "`ties`, read with mergekit's semantics and computed by mergelab's `ties`" in card
    assert "* base: `base`\n* model 0: `a`\n* model 1: `b`" in card
    assert "| `model.layers.1.{mlp.down_proj.weight" in card and "density=[0.8, 0.5]" in card
    assert "```yaml\nmerge_method: ties\nmodels:" in card
    record = json.loads((out / "mergelab_merge.json").read_text())
    assert record["dialect"] == "mergekit" and record["mergekit_method"] == "ties"
    assert "README.md" in json.loads((out / "mergelab_output.json").read_text())["entries"]


def test_older_model_spelling_of_a_tokenizer_source_and_unused_base_parameters(models, capsys):
    """``tokenizer_source: model:<path>`` (older mergekit's spelling) names a model; weights
    given to the base of a task-arithmetic method are unused, and --explain says so."""
    text = (
        "merge_method: ties\nbase_model: base\nmodels:\n"
        "  - {model: base, parameters: {weight: 0.3}}\n"
        "  - {model: a, parameters: {weight: 1}}\ntokenizer_source: model:b\n"
    )
    out = explain(write(models, text), capsys)
    assert "note: weight given to the base model is not used" in out
    assert "inputs: base=base, a; t = 0" in out
