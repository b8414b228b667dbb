"""`mergelab eval run` beyond one model folder: a composition or merge spec, sampling settings,
n samples with pass@k, device/dtype, EvalPlus samples — and every bad combination refused (exit 2)
before a model is loaded."""

import json
import string

import pytest
import torch
import yaml

from mergelab.cli import main
from mergelab.eval.spec import build_candidate
from mergelab.tiny import char_tokenizer, tiny_causal_lm

FIXTURES = __import__("pathlib").Path(__file__).resolve().parent / "fixtures" / "eval"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_cli_models")
    tok = char_tokenizer(string.printable)  # benchmark text has capitals and punctuation
    for seed, name in enumerate(["base", "math", "code"]):
        # HumanEval prompts run to ~600 characters, one token each.
        tiny_causal_lm(len(tok), seed=seed, max_positions=1024).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    (root / "compose.yaml").write_text(
        yaml.safe_dump(
            {
                "base": "base",
                "experts": ["math", "code"],
                "weights": [1.0, 0.5],
                "eos_policy": "base",
            }
        )
    )
    (root / "merge.yaml").write_text(
        yaml.safe_dump(
            {
                "merge": {
                    "method": "ties",
                    "base": "base",
                    "models": ["math", "code"],
                    "parameters": {"density": 0.5},
                }
            }
        )
    )
    return root


def test_a_composition_spec_with_sampling_and_n_samples(folders, tmp_path):
    argv = [
        "eval",
        "run",
        "--spec",
        str(folders / "compose.yaml"),
        "--benchmark",
        "gsm8k",
        "--data",
        str(FIXTURES / "gsm8k.jsonl"),
        "--max-new-tokens",
        "3",
        "--n-shots",
        "0",
        "--sample",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
        "--n-samples",
        "2",
        "--seed",
        "5",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["candidate"]["type"] == "ComposedDecoder"
    assert summary["candidate"]["eos_policy"] == "base"
    assert str(summary["candidate"]["composition"]["terms"][1]["weight"]) == "0.5"
    generation = summary["settings"]["generation"]
    assert (generation["do_sample"], generation["temperature"]) == (True, 0.8)
    assert (generation["top_p"], generation["top_k"], generation["seed"]) == (0.9, 20, 5)
    assert summary["settings"]["n_samples"] == 2 and summary["generated_this_call"] == 6
    items = [json.loads(x) for x in (tmp_path / "out" / "items.jsonl").read_text().splitlines()]
    assert all(len(it["samples"]) == 2 for it in items)


def test_a_merge_spec_on_code_with_pass_at_k_and_evalplus_samples(folders, tmp_path):
    samples = tmp_path / "samples.jsonl"
    argv = [
        "eval",
        "run",
        "--spec",
        str(folders / "merge.yaml"),
        "--benchmark",
        "humaneval+",
        "--data",
        str(FIXTURES / "humaneval_plus.jsonl"),
        "--max-new-tokens",
        "2",
        "--sample",
        "--n-samples",
        "3",
        "--pass-k",
        "1",
        "--pass-k",
        "3",
        "--isolation",
        "weak",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(tmp_path / "out"),
        "--evalplus-samples",
        str(samples),
    ]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["candidate"]["type"] == "ModelCandidate"
    assert summary["candidate"]["name"] == "ties(math, code)"
    assert {"pass@1_base", "pass@3_base", "pass@1_plus", "pass@3_plus"} <= set(summary["metrics"])
    lines = [json.loads(x) for x in samples.read_text().splitlines()]
    assert [x["task_id"] for x in lines] == [
        t for t in ["HumanEval/0", "HumanEval/2", "HumanEval/32"] for _ in range(3)
    ]


def test_dtype_and_device_reach_the_models(folders):
    candidate = build_candidate(folders / "compose.yaml", device="cpu", dtype="bfloat16")
    dtypes = {p.dtype for m in candidate.runner.models.values() for p in m.parameters()}
    assert dtypes == {torch.bfloat16}


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--n-samples", "2"], "n_samples > 1 with greedy decoding"),
        (["--sample", "--n-samples", "2", "--pass-k", "3"], "pass_k"),
        (["--temperature", "0.7"], "--temperature only apply when sampling"),
        (["--sample", "--top-p", "1.5"], "top_p must lie in"),
        (["--evalplus-samples", "s.jsonl"], "not a code benchmark"),
    ],
)
def test_bad_settings_exit_2_before_loading(folders, tmp_path, capsys, monkeypatch, extra, message):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.chdir(tmp_path)
    argv = [
        "eval",
        "run",
        "--spec",
        str(folders / "compose.yaml"),
        "--benchmark",
        "gsm8k",
        "--data",
        str(FIXTURES / "gsm8k.jsonl"),
        "--cache-dir",
        str(tmp_path / "c"),
        *extra,
    ]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_spec_and_model_are_exclusive_and_a_missing_spec_is_named(folders, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["eval", "run", "--spec", "a.yaml", "--model", "m", "--benchmark", "gsm8k"])
    assert info.value.code == 2
    capsys.readouterr()
    assert main(["eval", "run", "--spec", str(tmp_path / "nope.yaml"), "--benchmark", "gsm8k"]) == 2
    assert "nope.yaml not found" in capsys.readouterr().err


def test_an_expert_shipping_another_tokenizer_is_refused(folders, tmp_path):
    foreign = tmp_path / "foreign"
    tiny_causal_lm(len(char_tokenizer(string.printable)), seed=7).save_pretrained(foreign)
    char_tokenizer("abc").save_pretrained(foreign)
    spec = {"base": str(folders / "base"), "experts": [str(folders / "math"), str(foreign)]}
    with pytest.raises(ValueError, match="shared tokenizer"):
        build_candidate(spec)
    unshipped = tmp_path / "weights_only"  # an expert without tokenizer files is not checked
    tiny_causal_lm(len(char_tokenizer(string.printable)), seed=8).save_pretrained(unshipped)
    build_candidate({"base": str(folders / "base"), "experts": [str(unshipped)]})
