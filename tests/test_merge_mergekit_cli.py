"""mergekit-yaml's command line on `mergelab merge`: `CONFIG OUT` positionally, every flag of
mergekit's MergeOptions accepted with its meaning or refused in one line naming mergelab's way
(exit 2), and a misspelled `merge_method` named as such."""

from __future__ import annotations

import pytest
import torch
import yaml

from mergelab.cli import build_parser, main
from mergelab.merge.checkpoint import CheckpointFolder
from mergelab.tiny import tiny_causal_lm


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("mk")
    for seed, name in enumerate(("a", "b")):
        tiny_causal_lm(
            32,
            architecture="llama",
            hidden_size=16,
            num_layers=1,
            num_heads=2,
            intermediate_size=32,
            seed=seed,
        ).save_pretrained(root / name)
    path = root / "linear.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "merge_method": "linear",
                "dtype": "float32",
                "models": [
                    {"model": str(root / "a"), "parameters": {"weight": 0.3}},
                    {"model": str(root / "b"), "parameters": {"weight": 0.7}},
                ],
            }
        )
    )
    return path


def _tensors(folder):
    with CheckpointFolder(folder) as f:
        return {n: f.read(n).clone() for n in f.tensors}


def test_positional_output_and_accepted_flags_give_the_same_merge(config, tmp_path):
    threads = torch.get_num_threads()
    try:
        argv = [
            "merge",
            str(config),
            str(tmp_path / "pos"),
            "--lazy-unpickle",
            "--copy-tokenizer",
            "--trust-remote-code",
            "--clone-tensors",
            "--write-model-card",
            "--safe-serialization",
            "--async-write",
            "--random-seed",
            "0",
            "--quiet",
            "-j",
            "1",
            "--device",
            "cpu",
            "--no-trust-remote-code",
        ]
        assert main(argv) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert main(["merge", "--config", str(config), str(tmp_path / "cfg"), "--no-progress"]) == 0
    assert main(["merge", "--config", str(config), "--out", str(tmp_path / "out")]) == 0
    expected = _tensors(tmp_path / "out")
    for name in ("pos", "cfg"):
        got = _tensors(tmp_path / name)
        assert set(got) == set(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--cuda"], "--cuda: mergelab merges on the CPU"),
        (["--device", "cuda"], "--device cuda: mergelab merges on the CPU"),
        (["--gpu-rich"], "drop --gpu-rich"),
        (["--out-shard-size", "5B"], "use --shard-size 10GB (bfloat16/float16)"),
        (["--allow-crimes"], "one architecture only"),
        (["--unsafe-truncate-embeddings"], "--vocab-padding truncate"),
        (["--no-copy-tokenizer"], "always writes the base's tokenizer"),
        (["--no-write-model-card"], "always writes the model card"),
        (["--no-safe-serialization"], "safetensors only"),
        (["--transformers-cache", "/x"], "set HF_HUB_CACHE=/x"),
        (["--lora-merge-cache", "/x"], "merge the adapter into its model first"),
        (["--write-threads", "4"], "one background thread"),
        (["--random-seed", "1", "--seed", "2"], "disagree"),
    ],
)
def test_flags_mergelab_does_not_have_are_one_line_naming_its_way(
    config, tmp_path, capsys, extra, words
):
    assert main(["merge", str(config), str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err
    assert not (tmp_path / "o").exists()


def test_every_mergekit_option_is_handled():
    """Each field of mergekit's MergeOptions has its flag on `mergelab merge` (mergekit-yaml's
    spellings, --no-X for switches), so none is an argparse error."""
    pytest.importorskip("mergekit")
    from mergekit.options import MergeOptions

    parser = build_parser("merge")
    merge = next(a for a in parser._actions if a.dest == "command").choices["merge"]
    flags = set(merge._option_string_actions)
    missing = []
    for name, info in MergeOptions.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if name == "verbosity":
            flag = "-v"
        wanted = [flag] + (["--no-" + name.replace("_", "-")] if info.annotation is bool else [])
        if name == "gpu_rich":
            wanted = [flag]
        missing += [f for f in wanted if f not in flags]
    assert missing == []


def test_positional_forms_that_cannot_be_read_are_refused(config, tmp_path, capsys):
    root = config.parent  # a merge given by flags takes OUT positionally too
    flags = ["merge", "--method", "linear", "--model", str(root / "a"), "--model", str(root / "b")]
    assert main([*flags, str(tmp_path / "flags"), "--no-progress"]) == 0
    assert (tmp_path / "flags" / "config.json").is_file()
    assert main(["merge", str(tmp_path / "x.txt"), str(tmp_path / "o")]) == 2
    assert "is not a .yml, .yaml or .toml merge config" in capsys.readouterr().err
    assert main(["merge", str(config), str(tmp_path / "o"), "--out", str(tmp_path / "p")]) == 2
    assert "two outputs" in capsys.readouterr().err


def test_a_misspelled_merge_method_is_named(config, tmp_path, capsys):
    raw = yaml.safe_load(config.read_text())
    raw["merge_methd"] = raw.pop("merge_method")
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(raw))
    assert main(["merge", str(bad), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'merge_methd': did you mean 'merge_method' (mergekit's dialect)?" in err
