"""`mergelab merge`: flags, YAML/TOML configs, --dry-run, --force and exit-code-2 errors."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from mergelab.cli import main
from mergelab.merge import merge_state_dicts
from mergelab.merge.checkpoint import CheckpointFolder
from mergelab.tiny import tiny_causal_lm


def tiny_model(seed: int):
    return tiny_causal_lm(
        48,
        architecture="llama",
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        seed=seed,
        intermediate_size=32,
        num_key_value_heads=1,
        pad_token_id=None,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    base = tiny_model(0)
    sds = {"base": base.state_dict()}
    base.save_pretrained(root / "base")
    for name in ["math", "code"]:
        sd = {k: v + 0.05 * torch.randn(v.shape) for k, v in base.state_dict().items()}
        model = tiny_model(0)
        model.load_state_dict(sd)
        model.save_pretrained(root / name)
        sds[name] = model.state_dict()
    return root, sds


def read(folder):
    with CheckpointFolder(folder) as f:
        return {n: f.read(n).clone() for n in f.tensors}


def assert_equal_sd(got, expected):
    assert set(got) == set(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_flags_merge(models, tmp_path):
    root, sds = models
    out = tmp_path / "out"
    code = main(
        ["merge", "--method", "task_arithmetic", "--base", str(root / "base")]
        + ["--model", f"{root / 'math'}:0.5", "--model", f"{root / 'code'}:1.0"]
        + ["--param", "lambda=0.8", "--out", str(out), "--no-progress"]
    )
    assert code == 0
    expected = merge_state_dicts(
        "task_arithmetic",
        sds["base"],
        [sds["math"], sds["code"]],
        weights=[0.5, 1.0],
        params={"lambda": 0.8},
    )
    assert_equal_sd(read(out), expected)
    record = json.loads((out / "mergelab_merge.json").read_text())
    assert record["params"]["lambda_"] == 0.8 and record["per_model_params"]["weight"] == [0.5, 1]


def test_yaml_and_toml_configs_give_the_same_merge(models, tmp_path):
    root, sds = models
    config = {
        "method": "ties",
        "base": str(root / "base"),
        "models": [
            {"model": str(root / "math"), "parameters": {"weight": 1.0, "density": 0.3}},
            {"model": str(root / "code"), "parameters": {"weight": 0.5}},
        ],
        "parameters": {"lambda": 1.2, "density": 0.6, "trim_scope": "tensor"},
        "dtype": "float32",
        "seed": 0,
        "output": "merged-yaml",  # relative: resolved next to the config file
    }
    (tmp_path / "merge.yaml").write_text(yaml.safe_dump(config))
    toml = f"""method = "ties"
base = "{root / "base"}"
output = "merged-toml"
dtype = "float32"
[parameters]
lambda = 1.2
density = 0.6
trim_scope = "tensor"
[[models]]
model = "{root / "math"}"
parameters = {{ weight = 1.0, density = 0.3 }}
[[models]]
model = "{root / "code"}"
parameters = {{ weight = 0.5 }}
"""
    (tmp_path / "merge.toml").write_text(toml)
    assert main(["merge", "--config", str(tmp_path / "merge.yaml"), "--no-progress"]) == 0
    assert main(["merge", "--config", str(tmp_path / "merge.toml"), "--no-progress"]) == 0
    expected = merge_state_dicts(
        "ties",
        sds["base"],
        [sds["math"], sds["code"]],
        per_model_params={"weight": [1.0, 0.5], "density": [0.3, 0.6]},
        params={"lambda": 1.2, "trim_scope": "tensor"},
    )
    assert_equal_sd(read(tmp_path / "merged-yaml"), expected)
    assert_equal_sd(read(tmp_path / "merged-toml"), expected)


def test_dry_run_prints_the_plan_and_writes_nothing(models, tmp_path, capsys):
    root, _ = models
    out = tmp_path / "out"
    code = main(
        ["merge", "--method", "ties", "--base", str(root / "base")]
        + ["--models", str(root / "math"), str(root / "code")]
        + ["--param", "density=[0.2, 0.4]", "--out", str(out), "--dry-run", "--verbose"]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "method: ties" in text and '"density": [0.2, 0.4]' in text
    assert "model.layers.0.mlp.up_proj.weight" in text and "[32, 16]" in text
    n_bytes = sum(v.numel() * 4 for v in tiny_model(0).state_dict().values())
    assert f"estimated output size: {n_bytes / 1000:.1f} KB" in text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--method", "no_such_method", "--model", "{math}", "--out", "{out}"],
            "unknown merge method",
        ),
        (["--method", "linear", "--model", "{tmp}/missing", "--out", "{out}"], "does not exist"),
        (
            ["--method", "linear", "--model", "{math}", "--param", "oops", "--out", "{out}"],
            "KEY=VALUE",
        ),
        (
            ["--method", "linear", "--model", "{math}", "--param", "bogus=1", "--out", "{out}"],
            "bogus",
        ),
        (["--method", "ties", "--model", "{math}", "--out", "{out}"], "needs a base"),
        (["--method", "linear", "--model", "{math}"], "--out is required"),
        (["--method", "linear", "--model", "{math}", "--out", "{math}/inside"], "overlaps input"),
        (
            ["--method", "linear", "--model", "{math}", "--out", "{out}", "--dtype", "int3"],
            "unknown dtype",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message(models, tmp_path, capsys, argv, message):
    root, _ = models
    fill = {"math": root / "math", "out": tmp_path / "out", "tmp": tmp_path}
    argv = [a.format(**fill) for a in argv]
    assert main(["merge", *argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_force(models, tmp_path, capsys):
    root, sds = models
    out = tmp_path / "out"
    out.mkdir()
    argv = ["merge", "--method", "linear", "--models", str(root / "math"), str(root / "code")]
    argv += ["--out", str(out), "--no-progress"]
    assert main(argv) == 2
    assert "--force" in capsys.readouterr().err
    assert main([*argv, "--dry-run"]) == 2  # the plan reports it too
    assert main([*argv, "--force"]) == 0
    assert_equal_sd(read(out), merge_state_dicts("linear", None, [sds["math"], sds["code"]]))


def test_lora_adapters_through_the_cli(models, tmp_path, capsys):
    root, _ = models
    paths = []
    for seed in range(2):
        torch.manual_seed(seed)
        config = LoraConfig(r=2, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
        get_peft_model(tiny_model(0), config).save_pretrained(tmp_path / f"lora{seed}")
        paths.append(str(tmp_path / f"lora{seed}"))
    code = main(
        ["merge", "--method", "ties", "--models", *paths, "--param", "density=0.5"]
        + [
            "--lora-output",
            "adapter",
            "--rank",
            "2",
            "--out",
            str(tmp_path / "ad"),
            "--no-progress",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "SVD truncation" in text and "relative Frobenius error" in text
    assert (tmp_path / "ad" / "adapter_model.safetensors").is_file()
    marker = json.loads((tmp_path / "ad" / "mergelab_output.json").read_text())
    assert marker["kind"] == "lora-adapter" and "adapter_config.json" in marker["entries"]
    code = main(
        ["merge", "--method", "task_arithmetic", "--base", str(root / "base"), "--models", *paths]
        + ["--out", str(tmp_path / "full"), "--no-progress"]
    )
    assert code == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "full") is not None
    # a checkpoint and an adapter together are refused
    code = main(
        ["merge", "--method", "linear", "--models", paths[0], str(root / "math")]
        + ["--out", str(tmp_path / "mixed")]
    )
    assert code == 2 and "LoRA adapters" in capsys.readouterr().err


def test_force_refuses_a_folder_of_unrelated_files(models, tmp_path, monkeypatch, capsys):
    """Data loss once reproduced: `mergelab merge --out . --force` replaced a folder of user files."""
    root, _ = models
    work = tmp_path / "work"
    work.mkdir()
    for name in ["a.txt", "b.txt", "c.txt"]:
        (work / name).write_text("user data")
    argv = ["merge", "--method", "linear", "--models", str(root / "math"), str(root / "code")]
    argv += ["--no-progress", "--force"]
    assert main([*argv, "--out", str(work)]) == 2
    err = capsys.readouterr().err
    assert "3 entries mergelab did not write: a.txt, b.txt, c.txt" in err
    assert "Traceback" not in err
    assert main([*argv, "--out", str(work), "--dry-run"]) == 2  # the plan reports it too
    monkeypatch.chdir(work)
    assert main([*argv, "--out", "."]) == 2
    assert "current folder" in capsys.readouterr().err
    assert sorted(p.name for p in work.iterdir()) == ["a.txt", "b.txt", "c.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_record_has_absolute_paths_from_relative_flags(models, tmp_path, monkeypatch):
    root, _ = models
    monkeypatch.chdir(root)
    out = tmp_path / "out"
    argv = ["merge", "--method", "task_arithmetic", "--base", "base", "--models", "math", "code"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    record = json.loads((out / "mergelab_merge.json").read_text())
    assert record["base"] == str((root / "base").resolve())
    assert record["models"] == [str((root / m).resolve()) for m in ["math", "code"]]
    assert record["as_given"]["models"] == ["math", "code"]


def test_index_with_a_list_weight_map_is_one_clear_error(models, tmp_path, capsys):
    root, _ = models
    bad = tmp_path / "bad"
    shutil.copytree(root / "math", bad)
    (bad / "model.safetensors.index.json").write_text('{"weight_map": ["a", "b"]}')
    argv = ["merge", "--method", "linear", "--models", str(bad), str(root / "code")]
    assert main([*argv, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{bad / 'model.safetensors.index.json'}: 'weight_map' must map" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_disk_full_is_one_line_exit_1_and_the_old_output_stays(
    models, tmp_path, monkeypatch, capsys
):
    root, _ = models
    out = tmp_path / "out"
    argv = ["merge", "--method", "linear", "--models", str(root / "math"), str(root / "code")]
    argv += ["--out", str(out), "--no-progress", "--force"]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    from mergelab.merge import checkpoint

    def full(self, name, tensor):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.ShardWriter, "write", full)
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("mergelab merge: error: could not write") and "[ENOSPC]" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
