"""Inputs for ``probe.py`` under ``/tmp/inputs_probe``: tiny Llama models (base, math, code with
one character tokenizer; perm with as many tokens mapped to other ids), LoRA adapters of the base
and of a wider model, a model folder whose config.json nests 100 000 levels, deep YAML configs, a
FIFO, a mergekit config merging math and perm, and a candidate spec of the base.

    python benchmarks/inputs_probe/make_models.py
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

from peft import LoraConfig, get_peft_model

from mergelab.tiny import DEFAULT_ALPHABET, char_tokenizer, tiny_causal_lm

P = Path("/tmp/inputs_probe")


def main() -> None:
    root = P / "m"
    root.mkdir(parents=True, exist_ok=True)
    tok = char_tokenizer()
    for seed, name in enumerate(["base", "math", "code"]):
        model = tiny_causal_lm(
            len(tok), hidden_size=16, num_layers=1, seed=seed, architecture="llama"
        )
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    perm = char_tokenizer(DEFAULT_ALPHABET[::-1])  # same size, other ids
    model = tiny_causal_lm(len(perm), hidden_size=16, num_layers=1, seed=5, architecture="llama")
    model.save_pretrained(root / "perm")
    perm.save_pretrained(root / "perm")
    targets = ["q_proj", "v_proj"]
    for name, hidden in [("lora", 16), ("lora_other", 32)]:
        base = tiny_causal_lm(
            len(tok), hidden_size=hidden, num_layers=1, seed=0, architecture="llama"
        )
        config = LoraConfig(r=2, target_modules=targets, init_lora_weights=False)
        get_peft_model(copy.deepcopy(base), config).save_pretrained(root / name)
    deep = "[" * 100_000 + "]" * 100_000
    shutil.copytree(root / "code", P / "m_deep", dirs_exist_ok=True)
    (P / "m_deep" / "config.json").write_text(deep)
    (P / "deep.yaml").write_text(f"method: linear\nmodels: {deep}\n")
    (P / "deep_spec.yaml").write_text(f"name: x\nmodels: {deep}\n")
    if not (P / "fifo").exists():
        os.mkfifo(P / "fifo")
    (P / "spec_base.yaml").write_text(f"model: {root / 'base'}\n")
    models = "".join(
        f"  - model: {root / m}\n    parameters: {{weight: 1.0}}\n" for m in ("math", "perm")
    )
    (P / "mk_perm.yaml").write_text(f"merge_method: linear\nmodels:\n{models}dtype: float32\n")


if __name__ == "__main__":
    main()
