"""``mergelab compose`` on checkpoints saved to disk (full experts and LoRA adapters)."""

import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from mergelab.candidate import GenerationSettings
from mergelab.cli import main
from mergelab.compose import ComposedDecoder
from mergelab.tiny import char_tokenizer, tiny_causal_lm


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    tok = char_tokenizer()
    paths = {}
    for i, name in enumerate(["base", "math", "code"]):
        model = tiny_causal_lm(len(tok), seed=i, initializer_range=0.3)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        paths[name] = root / name
    base = tiny_causal_lm(len(tok), seed=0, initializer_range=0.3)
    torch.manual_seed(3)
    lora = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False),
    )
    lora.save_pretrained(root / "lora")
    paths["lora"] = root / "lora"
    other = char_tokenizer("abc")
    tiny_causal_lm(len(tok), seed=5).save_pretrained(root / "foreign")
    other.save_pretrained(root / "foreign")
    paths["foreign"] = root / "foreign"
    return paths, tok


def test_cli_writes_the_decoder_generations(checkpoints, tmp_path):
    paths, tok = checkpoints
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "ab"}\n')
    out = tmp_path / "gen.jsonl"
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
        "--eos-policy",
        "base",
        "--prompts-file",
        str(prompts),
        "--out",
        str(out),
        "--max-new-tokens",
        "6",
        "--sample",
        "--seed",
        "4",
        "--top-k",
        "10",
    ]
    assert main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["candidate"] == "base + 1.0·(math − base) + 0.5·(code − base)"
    from transformers import AutoModelForCausalLM

    load = lambda p: AutoModelForCausalLM.from_pretrained(p).eval()  # noqa: E731
    decoder = ComposedDecoder(
        load(paths["base"]),
        [load(paths["math"]), load(paths["code"])],
        tok,
        [1, 0.5],
        expert_names=["math", "code"],
        eos_policy="base",
    )
    expected = decoder.generate(
        ["hello", "ab"], GenerationSettings(max_new_tokens=6, do_sample=True, seed=4, top_k=10)
    )
    assert [r["token_ids"] for r in records] == [g.token_ids for g in expected]
    assert main(argv) == 2  # exists: refuses without --force
    assert main(argv + ["--force"]) == 0


def test_cli_lora_and_errors(checkpoints, tmp_path, capsys):
    paths, tok = checkpoints
    base = ["compose", "--base", str(paths["base"]), "--max-new-tokens", "3", "--prompt", "ab"]
    out = tmp_path / "lora.jsonl"
    assert main(base + ["--expert", str(paths["lora"]), "--lora", "--out", str(out)]) == 0
    # the LoRA fast path from the command line decodes what the Python API decodes
    from transformers import AutoModelForCausalLM

    base_model = AutoModelForCausalLM.from_pretrained(paths["base"]).eval()
    expected = ComposedDecoder.from_lora(base_model, [paths["lora"]], tok).generate(
        ["ab"], GenerationSettings(max_new_tokens=3)
    )
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["token_ids"] == expected[0].token_ids and record["text"] == expected[0].text
    assert main(base + ["--expert", str(paths["foreign"])]) == 2
    assert "shared tokenizer" in capsys.readouterr().err
    draft = ["--expert", str(paths["math"]), "--speculative", "--draft", str(paths["foreign"])]
    assert main(base + draft) == 2  # a draft shipping another tokenizer is refused too
    assert "shared tokenizer" in capsys.readouterr().err
    assert main(base + ["--expert", str(tmp_path / "missing")]) == 2


def run_cli(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any tokenizer or model load fails the test: errors must come before them."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a tokenizer or model was loaded")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_output_may_not_overwrite_an_input(checkpoints, tmp_path, capsys, no_model_loading):
    """Data loss once reproduced: --out <base>/model.safetensors --force overwrote the base."""
    paths, _ = checkpoints
    weights = paths["base"] / "model.safetensors"
    before = weights.read_bytes()
    prompts = tmp_path / "p.txt"
    prompts.write_text("ab\n")
    common = [
        "compose",
        "--base",
        str(paths["base"]),
        "--expert",
        str(paths["math"]),
        "--prompts-file",
        str(prompts),
        "--force",
    ]
    for out in [weights, paths["math"] / "gen.jsonl", prompts, paths["base"]]:
        code, err = run_cli([*common, "--out", str(out)], capsys)
        assert code == 2 and "overlaps input" in err and "Traceback" not in err
    assert weights.read_bytes() == before and prompts.read_text() == "ab\n"


def test_force_replaces_only_generations_mergelab_wrote(checkpoints, tmp_path, capsys):
    paths, _ = checkpoints
    out = tmp_path / "gen.jsonl"
    out.write_text("my own notes, not generations\n")
    argv = [
        "compose",
        "--base",
        str(paths["base"]),
        "--expert",
        str(paths["math"]),
        "--prompt",
        "ab",
        "--max-new-tokens",
        "2",
        "--out",
        str(out),
        "--force",
    ]
    code, err = run_cli(argv, capsys)
    assert code == 2 and "not a file mergelab wrote" in err
    assert out.read_text() == "my own notes, not generations\n"
    out.unlink()
    assert main(argv) == 0
    assert main(argv) == 0  # a file this command wrote is replaced
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == ["ab"]


def test_missing_base_is_named_before_the_tokenizer_is_loaded(
    checkpoints, tmp_path, capsys, no_model_loading
):
    paths, _ = checkpoints
    missing = tmp_path / "no-such-model"
    code, err = run_cli(
        ["compose", "--base", str(missing), "--expert", str(paths["math"]), "--prompt", "ab"],
        capsys,
    )
    assert code == 2 and f"model folder {missing} not found" in err
    assert "hub" not in err.lower() and "Traceback" not in err


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("p.jsonl", b'{"prompt": "ok"}\n{"prompt": oops}\n', r"p\.jsonl:2: not valid JSON"),
        ("p.jsonl", b'{"prompt": "ok"}\n{"text": "no prompt"}\n', r"p\.jsonl:2: no 'prompt'"),
        ("p.jsonl", b'{"prompt": 3}\n', r"p\.jsonl:1: a prompt must be a string"),
        ("p.json", b'{"prompt": "x"}', r"p\.json: a \.json prompts file must hold a list"),
        ("p.json", b"[1, 2]", r"p\.json: item 0: a prompt must be a string"),
        ("p.json", b"[oops", r"p\.json: not valid JSON"),
        ("p.txt", b"", r"p\.txt holds no prompts"),
        ("p.jsonl", b"\n  \n", r"p\.jsonl holds no prompts"),
        ("p.json", b"[]", r"p\.json holds no prompts"),
        ("p.txt", "caf\u00e9 au lait\n".encode("latin-1"), r"p\.txt is not UTF-8 text \(byte 0xe9"),
    ],
)
def test_prompts_file_errors_name_the_file_and_line(
    checkpoints, tmp_path, capsys, no_model_loading, name, content, message
):
    import re

    paths, _ = checkpoints
    (tmp_path / name).write_bytes(content)
    argv = [
        "compose",
        "--base",
        str(paths["base"]),
        "--expert",
        str(paths["math"]),
        "--prompts-file",
        str(tmp_path / name),
    ]
    code, err = run_cli(argv, capsys)
    assert code == 2 and re.search(message, err), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_json_prompts_file_is_read_as_json(tmp_path):
    from mergelab.compose.cli import read_prompts

    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(["2 + 2 =", {"prompt": "def f(x):"}]))
    assert read_prompts(path) == ["2 + 2 =", "def f(x):"]
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "a"}\n\n"b"\n')
    assert read_prompts(lines) == ["a", "b"]


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--max-new-tokens", "-1"),
        ("--max-new-tokens", "0"),
        ("--batch-size", "0"),
        ("--max-new-tokens", "x"),
    ],
)
def test_counts_are_checked_by_the_argument_parser(checkpoints, capsys, flag, value):
    paths, _ = checkpoints
    argv = [
        "compose",
        "--base",
        str(paths["base"]),
        "--expert",
        str(paths["math"]),
        "--prompt",
        "ab",
        flag,
        value,
    ]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("draft", ["ta", "math"])
def test_speculative_flag_gives_the_plain_composition(checkpoints, tmp_path, draft):
    paths, _ = checkpoints
    common = [
        "compose",
        "--base",
        str(paths["base"]),
        "--expert",
        str(paths["math"]),
        "--expert",
        str(paths["code"]),
        "--prompt",
        "hello",
        "--prompt",
        "ab",
        "--max-new-tokens",
        "24",
    ]
    plain, fast = tmp_path / "plain.jsonl", tmp_path / "fast.jsonl"
    assert main([*common, "--no-speculative", "--out", str(plain)]) == 0
    draft_arg = "ta" if draft == "ta" else str(paths[draft])
    argv = [*common, "--speculative", "--draft", draft_arg, "--gamma", "3", "--out", str(fast)]
    assert main(argv) == 0
    plain_records = [json.loads(line) for line in plain.read_text().splitlines()]
    fast_records = [json.loads(line) for line in fast.read_text().splitlines()]
    assert [r["token_ids"] for r in fast_records] == [r["token_ids"] for r in plain_records]
    assert fast_records[0]["candidate"].startswith("speculative")
    assert all(r["cost"]["drafted_tokens"] > 0 for r in fast_records)


def test_greedy_decoding_is_speculative_by_default_and_sampling_is_not(checkpoints, tmp_path):
    """Without --speculative / --no-speculative: greedy decoding is speculative (the same tokens
    and the same candidate name as plain composition; the draft ran), sampling is plain
    composition's (a seed's sample unchanged), --no-speculative is plain."""
    paths, _ = checkpoints
    common = [
        "compose",
        "--base",
        str(paths["base"]),
        "--expert",
        str(paths["math"]),
        "--expert",
        str(paths["code"]),
        "--prompt",
        "hello",
        "--prompt",
        "ab",
        "--max-new-tokens",
        "24",
    ]

    def records(*flags):
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}.jsonl"
        assert main([*common, *flags, "--out", str(out)]) == 0
        return [json.loads(line) for line in out.read_text().splitlines()]

    plain, default = records("--no-speculative"), records()
    assert [r["token_ids"] for r in default] == [r["token_ids"] for r in plain]
    assert [r["candidate"] for r in default] == [r["candidate"] for r in plain]
    assert all("drafted_tokens" not in r["cost"] for r in plain)
    assert all(r["cost"]["blocks"] > 0 for r in default)  # decoded speculatively
    sample = ["--sample", "--seed", "3"]
    sampled, sampled_plain = records(*sample), records(*sample, "--no-speculative")
    assert [r["token_ids"] for r in sampled] == [r["token_ids"] for r in sampled_plain]
    assert all("drafted_tokens" not in r["cost"] for r in sampled)


def test_speculative_only_flags_need_speculative(checkpoints, capsys):
    paths, _ = checkpoints
    common = ["compose", "--base", str(paths["base"]), "--expert", str(paths["math"])]
    argv = [*common, "--prompt", "ab", "--gamma", "3", "--no-speculative"]
    assert main(argv) == 2
    assert "--gamma: only with speculative decoding (off with --no-speculative" in (
        capsys.readouterr().err
    )
    argv = [*common, "--prompt", "ab", "--fixed-gamma", "--sample"]
    assert main(argv) == 2
    assert "--fixed-gamma: only with speculative decoding (off with --sample" in (
        capsys.readouterr().err
    )
    argv = [
        "compose",
        "--base",
        str(paths["base"]),
        "--expert",
        str(paths["math"]),
        "--prompt",
        "ab",
        "--speculative",
        "--draft",
        str(paths["base"]) + "-missing",
    ]
    assert main(argv) == 2
    assert "draft model folder" in capsys.readouterr().err
