"""``mergelab compose`` on checkpoints saved to disk (full experts and LoRA adapters)."""

import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from mergelab.candidate import GenerationSettings
from mergelab.cli import main
from mergelab.compose import ComposedDecoder
from mergelab.compose.tiny_models import char_tokenizer, tiny_causal_lm


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
    argv = ["compose", "--base", str(paths["base"]), "--expert", str(paths["math"]),
            "--expert", str(paths["code"]), "--expert-name", "math", "--expert-name", "code",
            "--weight", "1", "--weight", "0.5", "--eos-policy", "base",
            "--prompts-file", str(prompts), "--out", str(out), "--max-new-tokens", "6",
            "--sample", "--seed", "4", "--top-k", "10"]  # fmt: skip
    assert main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["candidate"] == "base + 1.0·(math − base) + 0.5·(code − base)"
    from transformers import AutoModelForCausalLM

    load = lambda p: AutoModelForCausalLM.from_pretrained(p).eval()  # noqa: E731
    decoder = ComposedDecoder(load(paths["base"]), [load(paths["math"]), load(paths["code"])], tok,
                              [1, 0.5], expert_names=["math", "code"], eos_policy="base")  # fmt: skip
    expected = decoder.generate(
        ["hello", "ab"], GenerationSettings(max_new_tokens=6, do_sample=True, seed=4, top_k=10)
    )
    assert [r["token_ids"] for r in records] == [g.token_ids for g in expected]
    assert main(argv) == 2  # exists: refuses without --force
    assert main(argv + ["--force"]) == 0


def test_cli_lora_and_errors(checkpoints, tmp_path, capsys):
    paths, _ = checkpoints
    base = ["compose", "--base", str(paths["base"]), "--max-new-tokens", "3", "--prompt", "ab"]
    assert main(base + ["--expert", str(paths["lora"]), "--lora"]) == 0
    assert "### ab" in capsys.readouterr().out
    assert main(base + ["--expert", str(paths["foreign"])]) == 2
    assert "shared tokenizer" in capsys.readouterr().err
    assert main(base + ["--expert", str(tmp_path / "missing")]) == 2
