"""Merge parameters and configs: strings read as numbers, value ranges, duplicate keys, one dtype
rule for the Python API and the command line. Each error names the parameter (and the model)."""

from __future__ import annotations

import math

import pytest
import torch

from mergelab.merge import MergeInputError, get_merge_method, merge_models, merge_state_dicts
from mergelab.merge.config import MergeConfig, ModelSpec, load_merge_config, merge_config_from_dict

BASE = {"w": torch.zeros(4)}
EXPERTS = [{"w": torch.tensor([1.0, 2.0, 3.0, 4.0])}, {"w": torch.tensor([4.0, 3.0, 2.0, 1.0])}]


# ---------------------------------------------------------------- strings where numbers go


def test_a_string_per_model_parameter_is_one_number_for_every_model():
    """weight="12" used to be iterated per character: weights [1.0, 2.0]."""
    globals_, lists = get_merge_method("linear").resolve(2, {"weight": "12"})
    assert lists["weight"] == [12.0, 12.0]
    globals_, lists = get_merge_method("ties").resolve(2, {"density": "0.5", "lambda": " 1.5 "})
    assert lists["density"] == [0.5, 0.5] and globals_["lambda_"] == 1.5
    _, lists = get_merge_method("ties").resolve(2, per_model_params={"weight": ["1", 0.5]})
    assert lists["weight"] == [1.0, 0.5]
    got = merge_state_dicts("linear", BASE, EXPERTS, params={"weight": "3"})
    torch.testing.assert_close(got["w"], merge_state_dicts("linear", BASE, EXPERTS)["w"])


@pytest.mark.parametrize(
    ("params", "per_model", "message"),
    [
        ({"density": "0.5x"}, None, "'ties': density must be a number, got '0.5x'"),
        (
            None,
            {"weight": ["1", "heavy"]},
            "'ties': weight of model 1 must be a number, got 'heavy'",
        ),
        ({"weight": True}, None, "weight must be a number, got True"),
        ({"weight": {"a": 1}}, None, "weight must be a number or a list of numbers"),
        ({"lambda": "nan"}, None, "lambda must be a finite number, got 'nan'"),
        (None, {"weight": [1.0, float("inf")]}, "weight of model 1 must be a finite number"),
        ({"lambda": [1, 2]}, None, r"lambda must be a number, got \[1, 2\]"),
        ({"lambda": 1, "lambda_": 2}, None, "give lambda or lambda_, not both"),
    ],
)
def test_conversion_errors_name_the_parameter_and_the_model(params, per_model, message):
    with pytest.raises(ValueError, match=message):
        merge_state_dicts("ties", BASE, EXPERTS, params=params, per_model_params=per_model)


def test_config_strings_are_numbers_and_errors_name_the_model(tmp_path):
    raw = {
        "method": "ties",
        "base": "base",
        "models": [{"model": "math", "parameters": {"density": "0.5"}}, "code"],
        "parameters": {"weight": "2", "lambda": "1.5", "density": "0.3"},
    }
    config = merge_config_from_dict(raw, root=tmp_path)
    global_params, per_model = config.split_params()
    assert per_model == {"density": [0.5, 0.3]}  # the global value is the code model's default
    resolved, lists = get_merge_method("ties").resolve(2, global_params, per_model)
    assert lists == {"weight": [2.0, 2.0], "density": [0.5, 0.3]} and resolved["lambda_"] == 1.5
    raw["models"][0]["parameters"]["density"] = "half"
    config = merge_config_from_dict(raw, root=tmp_path)
    with pytest.raises(ValueError, match=r"model .*math: parameter 'density' must be a number"):
        config.split_params()
    # a global per-model list still gives each model its own value
    config = MergeConfig(
        "ties",
        [ModelSpec("a", {"density": 0.4}), ModelSpec("b")],
        params={"density": [0.1, "0.2"]},
    )
    assert config.split_params()[1] == {"density": [0.4, 0.2]}


# ---------------------------------------------------------------- value ranges


@pytest.mark.parametrize(
    ("method", "params", "message"),
    [
        ("ties", {"density": 0}, r"density must lie in \(0, 1\], got 0"),
        ("dare_linear", {"density": -0.1}, r"density must lie in \(0, 1\]"),
        ("breadcrumbs", {"gamma": -0.01}, r"gamma must lie in \[0, 1\], got -0.01"),
        ("linear", {"weight": [1.0, -1.0]}, "weights sum to zero"),
    ],
)
def test_ranges_are_checked_before_any_tensor(method, params, message):
    with pytest.raises(ValueError, match=message):
        merge_state_dicts(method, BASE, EXPERTS, params=params)


@pytest.mark.parametrize("t", [-0.5, 1.5])
def test_slerp_t_outside_0_1_needs_extrapolate(t):
    base, expert = {"w": torch.tensor([1.0, 0.0])}, [{"w": torch.tensor([0.0, 1.0])}]
    with pytest.raises(ValueError, match=r"t=.* is outside \[0, 1\].*extrapolate=true"):
        merge_state_dicts("slerp", base, expert, params={"t": t})
    out = merge_state_dicts("slerp", base, expert, params={"t": t, "extrapolate": True})
    angle = t * math.pi / 2  # on the unit circle through both models
    torch.testing.assert_close(out["w"], torch.tensor([math.cos(angle), math.sin(angle)]))
    with pytest.raises(ValueError, match=r"dot_threshold must lie in \[0, 1\)"):
        merge_state_dicts("slerp", base, expert, params={"dot_threshold": 1.0})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"seed": "x"}, "seed must be an integer, got 'x'"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"seed": True}, "seed must be an integer, got True"),
        ({"shard_size": 0}, "shard_size must be a positive size .* got 0"),
        ({"shard_size": "-1GB"}, "shard_size must be a positive size .* got '-1GB'"),
        ({"shard_size": "lots"}, "shard_size must be a positive size"),
        ({"shard_size": "infGB"}, "shard_size must be a positive size"),
        ({"lora": {"rank": "r"}}, "lora rank must be an integer, got 'r'"),
        ({"vocab_padding": "pad"}, "vocab_padding must be one of error, truncate"),
        ({"parameters": [1, 2]}, "'parameters' must be a mapping"),
        ({1: "x"}, r"unknown key\(s\) \['1'\]"),
    ],
)
def test_config_values_are_checked_naming_the_key(raw, message):
    with pytest.raises(ValueError, match=message):
        merge_config_from_dict({"method": "linear", "models": ["a"], **raw})


def test_seed_given_as_a_numeric_string_is_read():
    assert merge_config_from_dict({"method": "linear", "models": ["a"], "seed": "7"}).seed == 7


# ---------------------------------------------------------------- config files


def test_a_key_given_twice_in_yaml_is_refused(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("method: linear\nseed: 1\nmodels: [a]\nseed: 2\n")
    with pytest.raises(
        ValueError, match=r"merge\.yaml:4:1: .*duplicate key 'seed' \(first .*line 2\)"
    ):
        load_merge_config(path)
    path.write_text(
        "method: linear\nmodels:\n  - model: a\n    parameters: {weight: 1, weight: 2}\n"
    )
    with pytest.raises(ValueError, match="duplicate key 'weight'"):
        load_merge_config(path)
    # YAML merge keys may still be overridden, as YAML intends
    path.write_text(
        "d: &d {weight: 1}\nmethod: linear\nmodels: [{model: a, parameters: {<<: *d, weight: 2}}]\n"
    )
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['d'\]"):  # parsed fine, then checked
        load_merge_config(path)


def test_a_key_given_twice_in_toml_is_refused(tmp_path):
    path = tmp_path / "merge.toml"
    path.write_text('method = "linear"\nmodels = ["a"]\nseed = 1\nseed = 2\n')
    with pytest.raises(ValueError, match=r"merge\.toml: invalid TOML: .*line 4"):
        load_merge_config(path)


def test_config_file_errors_are_one_line_naming_the_file(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("method: linear\nmodels: [a\nseed: 1\n")
    with pytest.raises(ValueError, match=r"merge\.yaml:3:5: invalid YAML: ") as info:
        load_merge_config(path)
    assert "\n" not in str(info.value)
    path.write_bytes("method: linear\nmodels: [a]\n# café\n".encode("latin-1"))
    with pytest.raises(
        ValueError, match=r"merge\.yaml:3: not UTF-8 text \(byte 0xe9 at byte offset 32\)"
    ):
        load_merge_config(path)
    with pytest.raises(IsADirectoryError, match="is not a file"):
        load_merge_config(tmp_path)


# ---------------------------------------------------------------- one dtype rule


def test_merge_models_refuses_mixed_dtypes_like_the_cli():
    torch.manual_seed(0)
    base, expert = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    with pytest.raises(
        MergeInputError,
        match=r"tensor 'weight' is torch.bfloat16 in expert 0 but "
        r"torch.float32 in base; convert the models to one dtype first",
    ):
        merge_models("task_arithmetic", base, [expert.to(torch.bfloat16)])
    with pytest.raises(MergeInputError, match="convert the models to one dtype first"):
        merge_state_dicts("linear", None, [{"w": torch.ones(2)}, {"w": torch.ones(2).half()}])
    merged = merge_models("task_arithmetic", base.to(torch.bfloat16), [expert.to(torch.bfloat16)])
    assert merged.weight.dtype == torch.bfloat16


def test_the_dtype_rule_is_one_function():
    from mergelab.merge.validation import check_same_dtype

    check_same_dtype("w", [torch.float32, torch.float32], ["base", "model 0"])
    with pytest.raises(MergeInputError, match="'w' is torch.float16 in model 1 but torch.float32"):
        check_same_dtype("w", [torch.float32] * 2 + [torch.float16], ["base", "model 0", "model 1"])
