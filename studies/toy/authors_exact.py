"""The authors' letter-replacement notebook, reproduced setting by setting (docs/composition.md §4).

Base = identity, experts A→B and C→D, each trained from scratch on 2000 random strings of
length 16 over space + A–Z, the target aligned with the input position by position. What the
notebook does, and so what this recipe does:

* ``GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=27)``, every other
  field at its default — dropout 0.1 in embeddings, attention and residuals;
* ``torch.optim.AdamW(lr=3e-4)`` with its default weight decay 0.01, no schedule;
* batch 1, 5 epochs, the 2000 examples visited in the same fixed order every epoch;
* a 27-token vocabulary (space + A–Z: no pad, separator or end-of-sequence token);
* evaluation: one forward pass of each model, then at every position the argmax of
  ``log p1 + log p2 − log p_b``.

Not in the notebook, so chosen here: the seeds (model ``i`` of seed ``s`` starts from
``torch.manual_seed(100 s + i)``, data from ``random.Random(s)``) and the test strings. With
``n_positions = 32`` no input longer than 32 fits, so the length sweep is 1..32.

    python -m studies.toy.authors_exact --seeds 0 1 2     # 15-25 min per seed on a loaded 2-core box

Writes results/toy/authors_exact.json (config, per seed: training log and joint exact match of
every row at every length). The product of experts without a base is one more row.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from mergelab.results import json_with_keys, write_json_atomic
from mergelab.toy import ALPHABET, LetterMap, parallel_target, random_strings

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "n_positions": 32, "vocab_size": 27},
    "dropout": 0.1,  # GPT2Config's default, kept by the notebook
    "optimizer": {"name": "AdamW", "lr": 3e-4, "weight_decay": 0.01},  # AdamW's defaults
    "epochs": 5,
    "batch_size": 1,
    "data_order": "fixed",
    "n_train": 2000,
    "train_length": 16,
    "alphabet": ALPHABET,
}
STOI = {c: i for i, c in enumerate(ALPHABET)}  # 27 tokens, one per character


def ids(strings: list[str]) -> torch.Tensor:
    """``[N, L]`` token ids of equal-length strings."""
    return torch.tensor([[STOI[c] for c in s] for s in strings], dtype=torch.long)


def optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    """The notebook's ``torch.optim.AdamW(model.parameters(), lr=3e-4)``: weight decay 0.01."""
    return torch.optim.AdamW(model.parameters(), lr=CONFIG["optimizer"]["lr"])


def train(letter_map: LetterMap, xs: list[str], seed: int) -> tuple[GPT2LMHeadModel, dict]:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG["model"]))
    opt = optimizer(model)
    inputs, targets = ids(xs), ids([letter_map(x) for x in xs])
    model.train()  # dropout 0.1 is on while training
    t0, losses = time.perf_counter(), []
    for _ in range(CONFIG["epochs"]):
        for i in range(len(xs)):  # fixed order, batch 1
            logits = model(input_ids=inputs[i : i + 1]).logits  # [1, L, 27]; logits[t] → y[t]
            loss = F.cross_entropy(logits[0], targets[i])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    model.eval()
    seconds = round(time.perf_counter() - t0, 1)
    return model, {
        "mean_loss_last_100": sum(losses[-100:]) / 100,
        "steps": len(losses),
        "seconds": seconds,
    }


@torch.no_grad()
def predictions(models: dict, xs: list[str]) -> dict[str, list[str]]:
    """One forward per model; per-position argmax of each row's score (aligned: no shift)."""
    lp = {k: F.log_softmax(m(input_ids=ids(xs)).logits, -1) for k, m in models.items()}
    scores = {
        "base": lp["base"],
        "expert A->B": lp["A->B"],
        "expert C->D": lp["C->D"],
        "composition": lp["A->B"] + lp["C->D"] - lp["base"],
        "product of experts (no base)": lp["A->B"] + lp["C->D"],
    }
    return {
        k: ["".join(ALPHABET[i] for i in row) for row in s.argmax(-1).tolist()]
        for k, s in scores.items()
    }


def run(seed: int, n_test: int) -> dict:
    rng = random.Random(seed)
    maps = {"base": LetterMap(), "A->B": LetterMap.parse("A->B"), "C->D": LetterMap.parse("C->D")}
    models, logs = {}, {}
    for i, (name, m) in enumerate(maps.items()):
        xs = random_strings(CONFIG["n_train"], CONFIG["train_length"], rng)
        models[name], logs[name] = train(m, xs, seed=100 * seed + i)
    test_rng = random.Random(10_000 + seed)
    success: dict[str, dict[int, float]] = {}
    for length in range(1, CONFIG["model"]["n_positions"] + 1):
        xs = random_strings(n_test, length, test_rng)
        joint = [parallel_target([maps["A->B"], maps["C->D"]], x) for x in xs]
        for row, preds in predictions(models, xs).items():
            hits = sum(p == t for p, t in zip(preds, joint))
            success.setdefault(row, {})[length] = hits / n_test
    return {"seed": seed, "train": logs, "joint_exact_match_by_length": success}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--n-test", type=int, default=200, help="test strings per length")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "toy" / "authors_exact.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    runs = []
    for s in args.seeds:
        runs.append(run(s, args.n_test))
        print(f"seed {s} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    config = {**CONFIG, "n_test_per_length": args.n_test, "seeds": args.seeds}
    result = {"config": config, "runs": runs, "seconds": round(time.perf_counter() - t0, 1)}
    write_json_atomic(
        args.out, result, indent=1, written_by_mergelab=json_with_keys("config", "runs")
    )
    for r in runs:
        for name, by_len in r["joint_exact_match_by_length"].items():
            perfect = sum(v == 1.0 for v in by_len.values())
            print(
                f"seed {r['seed']} {name:<30} length 16: {100 * by_len[16]:5.1f}%   "
                f"100% at {perfect}/{len(by_len)} lengths"
            )
    print(f"{result['seconds']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
