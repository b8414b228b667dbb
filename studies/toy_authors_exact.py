"""The authors' letter-replacement protocol at their exact settings (docs/composition.md §4), nothing else.

Base = identity, experts A→B and C→D, each trained from scratch on 2000 random strings of
length 16 over A–Z + space, target aligned with the input; GPT-2 with 2 layers, 2 heads, width
64; AdamW lr 3e-4, batch 1, 5 epochs. Evaluated through the Candidate interface (per-position
argmax of ``token_logprobs``) at every length 1..64.

    python studies/toy_authors_exact.py              # seed 0, ~4 min of CPU
    python studies/toy_authors_exact.py --seeds 0 1 2

Writes results/toy/authors_exact.json (config, seeds, per-length success of every row).
``studies/toy_letters.py`` runs this protocol with batch 16 (same lr, epochs) among everything else.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from mergelab.compose import ComposedDecoder, ModelCandidate
from mergelab.outputs import atomic_output_file
from mergelab.toy import (
    AlignedTask,
    LetterMap,
    TrainConfig,
    build_char_tokenizer,
    exact_match,
    parallel_target,
    random_strings,
    tiny_gpt2,
    train_model,
)
from mergelab.toy.evaluate import aligned_predictions

ROOT = Path(__file__).resolve().parents[1]
AUTHORS = TrainConfig(epochs=5, batch_size=1, lr=3e-4)


def run(seed: int, n_test: int) -> dict:
    tok = build_char_tokenizer()
    task = AlignedTask(tok)
    rng = random.Random(seed)
    maps = [LetterMap.parse("A->B"), LetterMap.parse("C->D")]
    models, logs = [], {}
    for i, m in enumerate([LetterMap(), *maps]):
        xs = random_strings(2000, 16, rng)
        model = tiny_gpt2(len(tok), seed=seed * 100 + i)
        logs[m.name] = train_model(model, *task.encode(xs, [m(x) for x in xs]), AUTHORS)
        models.append(model)
    rows = [ModelCandidate(models[0], tok, name="base")]
    rows += [ModelCandidate(e, tok, name=f"expert {m.name}") for e, m in zip(models[1:], maps)]
    rows += [ComposedDecoder(models[0], models[1:], tok, name="composition")]
    test_rng = random.Random(10_000 + seed)
    success: dict[str, dict[int, float]] = {c.name: {} for c in rows}
    for length in range(1, 65):
        xs = random_strings(n_test, length, test_rng)
        joint = [parallel_target(maps, x) for x in xs]
        for c in rows:
            success[c.name][length] = float(
                exact_match(aligned_predictions(c, task, xs), joint).mean()
            )
    return {"seed": seed, "train": logs, "joint_exact_match_by_length": success}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--n-test", type=int, default=200, help="test strings per length")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "toy" / "authors_exact.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    runs = [run(s, args.n_test) for s in args.seeds]
    result = {
        "config": {
            "train": AUTHORS.to_dict(),
            "n_train": 2000,
            "train_length": 16,
            "n_test": args.n_test,
        },
        "runs": runs,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    with atomic_output_file(args.out) as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    for r in runs:
        for name, by_len in r["joint_exact_match_by_length"].items():
            at16 = by_len[16]
            perfect = [n for n, v in by_len.items() if v == 1.0]
            print(
                f"seed {r['seed']} {name:<14} length 16: {100 * at16:5.1f}%   100% at {len(perfect)}/64 lengths"
            )
    print(f"{result['seconds']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
