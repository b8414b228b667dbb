"""The built-in examples of ``mergelab compare``: comparisons that run in minutes on 2 CPU cores.

``--example letters`` (:func:`prepare_letters_example`): the toy letter-replacement task — a
copying base, A→B and C→D experts fine-tuned from it, and three benchmarks (``a_to_b``,
``c_to_d``, ``both``) of the ``letter_map`` task, where the expected outcome is known (logit
composition solves ``both``, no single expert does). ``--example tiny``, below:

It makes its own inputs, offline, in ``<cache>/example`` (reused by a rerun):

* a character-level base model (a 2-layer Llama, width 64, about 0.1M parameters) pretrained on
  :func:`mergelab.synthetic.pretraining_corpus`, and two experts fine-tuned from it on the
  synthetic ``math`` (word problems, "#### n") and ``code`` (function from docstring) tasks of
  :mod:`mergelab.synthetic`; saved as Hugging Face folders;
* the two benchmarks as JSONL files (validation and test items drawn apart from training);
* ``spec.yaml`` — the same as ``examples/compare_tiny.yaml``.

The numbers are those of tiny models trained for seconds: the point is the pipeline and the
table, not the science (the LLM study in studies/ is that).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from mergelab.outputs import atomic_output_dir, atomic_output_file

SPEC_YAML = """\
# A comparison of a tiny base, its math and code experts, their logit composition and weight
# merges, on synthetic math and code benchmarks. `mergelab compare --example tiny --out DIR`
# trains the models and writes the data next to this spec; docs/compare.md explains every key.
name: compare-tiny
models:
  base: models/base
  experts:
    math: models/math
    code: models/code
candidates:
  - family: base
  - family: expert                  # each expert; the best one per benchmark is chosen on validation
  - family: composition             # base + w·(math − base) + w·(code − base)
    grid: {weight: [0.5, 1.0]}
  - family: merge
    method: task_arithmetic
    grid: {lambda: [0.5, 1.0]}
  - family: merge
    method: ties
    grid: {density: [0.2, 0.5]}
benchmarks:
  - name: math
    file: data/math.jsonl
    task: synth_math
    split: {validation: 30, test: 100}  # drawn with each seed; the ids are recorded
    generation: {max_new_tokens: 40, batch_size: 50}
  - name: code
    file: data/code.jsonl
    task: synth_code
    split: {validation: 30, test: 100}
    generation: {max_new_tokens: 32, batch_size: 50}
    eval: {isolation: {isolation}}
selection: {metric: mean, tie_break: first}
statistics: {bootstrap_samples: 2000}
seeds: [0]
"""

TRAIN = {
    "pretrain_steps": 150,
    "expert_steps": 200,
    "batch_size": 16,
    "lr": 5e-3,
    "hidden_size": 64,
    "num_layers": 2,
    "n_train": 1000,
    "n_held_out": 130,
}


def spec_text(isolation: str = "namespaces") -> str:
    """The example's spec, with the sandbox isolation of its code benchmark."""
    return SPEC_YAML.replace("{isolation}", isolation)


def _records(skill: str, items: list[dict]) -> list[dict]:
    if skill == "math":
        return [
            {
                "item_id": it["id"],
                "prompt": it["question"],
                "answer": it["answer"],
                "solution": it["target"],
            }
            for it in items
        ]
    return [
        {
            "item_id": it["id"],
            "prompt": it["prompt"],
            "solution": it["target"],
            "tests": {"entry_point": it["entry_point"], "asserts": list(it["tests"])},
        }
        for it in items
    ]


def _train(
    model, tok, texts: list[str], steps: int, seed: int, progress: str | None
) -> list[float]:
    from mergelab.tiny import train

    rng = random.Random(seed)

    def batches():
        while True:
            batch = [rng.choice(texts) + tok.eos_token for _ in range(TRAIN["batch_size"])]
            yield tok(batch, padding=True, padding_side="right", return_tensors="pt")

    def loss(model, enc):
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        return model(
            input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels
        ).loss

    torch.manual_seed(seed)
    return train(model, batches(), loss, lr=TRAIN["lr"], steps=steps, progress=progress)


def prepare_tiny_example(folder: str | Path, *, seed: int = 0, progress: bool = True) -> Path:
    """Train (or reuse) the models, write the data and the spec; returns the spec's path."""
    from mergelab.synthetic import make_splits, mini_tokenizer, pretraining_corpus
    from mergelab.synthetic.tasks import qa_prompt
    from mergelab.tiny import tiny_llama

    folder = Path(folder)
    done = folder / "recipe.json"
    recipe = {"train": TRAIN, "seed": seed}
    isolation = "namespaces"
    try:
        from mergelab.eval.sandbox import Sandbox

        Sandbox(workers=1).close()
    except Exception:  # noqa: BLE001 - no namespaces here: say so in the spec, run weakly isolated
        isolation = "weak"
    if done.is_file() and json.loads(done.read_text())["recipe"] == recipe:
        write_spec(folder / "spec.yaml", isolation)  # the tasks this mergelab registers
        return folder / "spec.yaml"
    tok = mini_tokenizer()
    splits = {
        s: make_splits(s, {"train": TRAIN["n_train"], "held_out": TRAIN["n_held_out"]}, seed=seed)
        for s in ("math", "code")
    }
    log: dict[str, float] = {}
    t0 = time.time()
    with atomic_output_dir(folder, force=True, kind="compare-example") as tmp:
        base = tiny_llama(
            tok,
            hidden_size=TRAIN["hidden_size"],
            num_layers=TRAIN["num_layers"],
            num_heads=4,
            seed=seed,
        )
        docs = pretraining_corpus(4000, seed=seed)
        losses = _train(
            base, tok, docs, TRAIN["pretrain_steps"], seed, "base" if progress else None
        )
        log["base"] = losses[-1]
        base.save_pretrained(tmp / "models" / "base")
        tok.save_pretrained(tmp / "models" / "base")
        for i, skill in enumerate(("math", "code")):
            expert = tiny_llama(
                tok,
                hidden_size=TRAIN["hidden_size"],
                num_layers=TRAIN["num_layers"],
                num_heads=4,
                seed=seed,
            )
            expert.load_state_dict(base.state_dict())
            train_items = splits[skill]["train"]
            texts = [
                (qa_prompt(it["question"]) if skill == "math" else it["prompt"]) + it["target"]
                for it in train_items
            ]
            losses = _train(
                expert, tok, texts, TRAIN["expert_steps"], seed + 1 + i, skill if progress else None
            )
            log[skill] = losses[-1]
            expert.save_pretrained(tmp / "models" / skill)
            tok.save_pretrained(tmp / "models" / skill)
            (tmp / "data").mkdir(exist_ok=True)
            with open(tmp / "data" / f"{skill}.jsonl", "w", encoding="utf-8") as f:
                for rec in _records(skill, splits[skill]["held_out"]):
                    f.write(json.dumps(rec) + "\n")
        (tmp / "spec.yaml").write_text(spec_text(isolation), encoding="utf-8")
        record = {"recipe": recipe, "final_loss": log, "seconds": time.time() - t0}
        (tmp / "recipe.json").write_text(json.dumps(record))
    return folder / "spec.yaml"


def write_spec(path: str | Path, isolation: str = "namespaces") -> None:
    """Write the example's spec (what ``examples/compare_tiny.yaml`` holds)."""
    with atomic_output_file(path, force=True) as tmp:
        tmp.write_text(spec_text(isolation), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# ``mergelab compare --example letters``: the toy letter-replacement task


LETTERS_SPEC_YAML = """\
# The toy letter-replacement task (README, "Toy letter replacement"): a copying base and two
# experts fine-tuned from it, one rewriting A→B, one C→D (generative protocol: "x[SEP]y[EOS]").
# `both` needs both rewrites: no single expert can solve it. `mergelab compare --example letters
# --out DIR` trains the models and writes the data next to this spec (docs/compare.md).
name: compare-letters
models:
  base: models/base                 # copies its input
  experts:
    a_to_b: models/a_to_b
    c_to_d: models/c_to_d
candidates:
  - family: base
  - family: expert
  - family: composition             # logits: base + w·(a_to_b − base) + w·(c_to_d − base)
    grid: {weight: [0.5, 1.0]}
  - family: merge
    method: task_arithmetic
    grid: {lambda: [0.5, 1.0, 1.5]}
  - family: merge
    method: ties
    grid: {density: [0.2, 0.5]}
  - family: merge
    method: dare_ties
    grid: {density: [0.2, 0.5]}
  - family: merge
    method: linear                  # the plain average of the two experts
generation: {max_new_tokens: 12, batch_size: 100}
benchmarks:
  - name: a_to_b                    # strings with an A and no C
    file: data/a_to_b.jsonl
    task: letter_map
    split: {validation: 40, test: 100}
  - name: c_to_d                    # strings with a C and no A
    file: data/c_to_d.jsonl
    task: letter_map
    split: {validation: 40, test: 100}
  - name: both                      # strings with an A and a C
    file: data/both.jsonl
    task: letter_map
    split: {validation: 40, test: 100}
selection: {metric: mean, tie_break: first}
statistics: {bootstrap_samples: 2000}
seeds: [0]
"""

LETTERS_TRAIN = {
    "length": 8,  # every string has this many characters (space and A–Z)
    "base_steps": 600,
    "expert_steps": 200,
    "batch_size": 32,
    "lr": 3e-3,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 2,
    "n_held_out": 140,  # items per benchmark file (validation + test)
    # Trained on one thread whatever --threads says: the float summation order then does not
    # depend on the thread count, and the models (and the merges near their edge) are the same.
    "threads": 1,
}
LETTER_EXPERTS = {"a_to_b": "A->B", "c_to_d": "C->D"}


def letters_spec_text() -> str:
    """The letters example's spec (what ``examples/compare_letters.yaml`` holds)."""
    return LETTERS_SPEC_YAML


def letter_benchmark_items(n: int, seed: int, length: int, exclude=frozenset()) -> dict:
    """``n`` items for each benchmark — ``a_to_b`` (an A, no C), ``c_to_d`` (a C, no A), ``both``
    (an A and a C) — drawn with ``seed``: records ``{item_id, prompt, answer}`` with the answer
    both maps applied (each letter is rewritten by the one map that touches it). Strings in
    ``exclude`` (the training strings) are skipped; no string is in two benchmarks."""
    from mergelab.toy.tasks import LetterMap, parallel_target, random_strings

    maps = [LetterMap.parse(m) for m in LETTER_EXPERTS.values()]
    wanted = {
        "a_to_b": lambda s: "A" in s and "C" not in s,
        "c_to_d": lambda s: "C" in s and "A" not in s,
        "both": lambda s: "A" in s and "C" in s,
    }
    rng = random.Random(seed)
    out: dict[str, list[dict]] = {name: [] for name in wanted}
    seen = set(exclude)
    while any(len(v) < n for v in out.values()):
        (s,) = random_strings(1, length, rng)
        if s in seen:
            continue
        for name, ok in wanted.items():
            if ok(s) and len(out[name]) < n:
                seen.add(s)
                answer = parallel_target(maps, s)
                out[name].append(
                    {"item_id": f"{name}/{len(out[name])}", "prompt": s, "answer": answer}
                )
    return out


def _train_letters(model, tok, letter_map: str, steps: int, seed: int, progress: str | None):
    """Fine-tune ``model`` on ``x[SEP]map(x)[EOS]`` for fresh random strings ``x``; returns the
    losses and the training strings."""
    import torch.nn.functional as F

    from mergelab.tiny import train
    from mergelab.toy.tasks import GenerativeTask, LetterMap, random_strings

    rng = random.Random(seed)
    fn = LetterMap.parse(letter_map)
    task = GenerativeTask(tok)
    seen: set[str] = set()

    def batches():
        while True:
            xs = random_strings(LETTERS_TRAIN["batch_size"], LETTERS_TRAIN["length"], rng)
            seen.update(xs)
            yield task.encode(xs, [fn(x) for x in xs])

    def loss(model, batch):
        input_ids, labels = batch
        logits = model(input_ids=input_ids, attention_mask=(input_ids != tok.pad_token_id)).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    torch.manual_seed(seed)
    losses = train(model, batches(), loss, lr=LETTERS_TRAIN["lr"], steps=steps, progress=progress)
    return losses, seen


def prepare_letters_example(folder: str | Path, *, seed: int = 0, progress: bool = True) -> Path:
    """Train (or reuse) the copying base and the A→B / C→D experts (tiny GPT-2s, fine-tuned from
    the base), write the three benchmarks and the spec; returns the spec's path. ``recipe.json``
    records the training losses and its wall and CPU seconds."""
    from mergelab.toy.tokenizer import build_char_tokenizer

    folder = Path(folder)
    done = folder / "recipe.json"
    recipe = {"example": "letters", "train": LETTERS_TRAIN, "experts": LETTER_EXPERTS, "seed": seed}
    if done.is_file() and json.loads(done.read_text()).get("recipe") == recipe:
        write_letters_spec(folder / "spec.yaml")
        return folder / "spec.yaml"
    threads = torch.get_num_threads()
    torch.set_num_threads(LETTERS_TRAIN["threads"])
    try:
        _build_letters_example(folder, build_char_tokenizer(), recipe, seed, progress)
    finally:
        torch.set_num_threads(threads)
    return folder / "spec.yaml"


def _build_letters_example(folder: Path, tok, recipe: dict, seed: int, progress: bool) -> None:
    from mergelab.tiny import tiny_gpt2

    t0, c0 = time.time(), time.process_time()
    log: dict[str, float] = {}
    with atomic_output_dir(folder, force=True, kind="compare-example") as tmp:

        def build():
            return tiny_gpt2(
                tok,
                n_embd=LETTERS_TRAIN["n_embd"],
                n_layer=LETTERS_TRAIN["n_layer"],
                n_head=LETTERS_TRAIN["n_head"],
                seed=seed,
            )

        base = build()
        losses, trained_on = _train_letters(
            base, tok, "identity", LETTERS_TRAIN["base_steps"], seed, "base" if progress else None
        )
        log["base"] = losses[-1]
        base.save_pretrained(tmp / "models" / "base")
        tok.save_pretrained(tmp / "models" / "base")
        for i, (name, letter_map) in enumerate(LETTER_EXPERTS.items()):
            expert = build()
            expert.load_state_dict(base.state_dict())
            losses, seen = _train_letters(
                expert,
                tok,
                letter_map,
                LETTERS_TRAIN["expert_steps"],
                seed + 1 + i,
                name if progress else None,
            )
            trained_on |= seen
            log[name] = losses[-1]
            expert.save_pretrained(tmp / "models" / name)
            tok.save_pretrained(tmp / "models" / name)
        items = letter_benchmark_items(
            LETTERS_TRAIN["n_held_out"], seed + 100, LETTERS_TRAIN["length"], trained_on
        )
        (tmp / "data").mkdir()
        for name, records in items.items():
            with open(tmp / "data" / f"{name}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(rec) + "\n" for rec in records)
        (tmp / "spec.yaml").write_text(letters_spec_text(), encoding="utf-8")
        record = {
            "recipe": recipe,
            "final_loss": log,
            "wall_seconds": time.time() - t0,
            "cpu_seconds": time.process_time() - c0,
        }
        (tmp / "recipe.json").write_text(json.dumps(record, indent=1))


def write_letters_spec(path: str | Path) -> None:
    """Write the letters example's spec (what ``examples/compare_letters.yaml`` holds)."""
    with atomic_output_file(path, force=True) as tmp:
        tmp.write_text(letters_spec_text(), encoding="utf-8")


EXAMPLES = {"tiny": prepare_tiny_example, "letters": prepare_letters_example}
