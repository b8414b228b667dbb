"""Run a :class:`~mergelab.candidate.Candidate` on a toy task and score its predictions.

Every row of a toy table — base, expert, composition, each weight merge — goes through the same
calls. Generative rows (``x [SEP] y [EOS]``, greedy until EOS) go through
:func:`mergelab.compare.run`, in every recipe of the study: :func:`compare_letters` builds the
spec (in-memory models and the registered ``letter_map`` / ``letter_skill`` tasks of
:mod:`mergelab.eval.letter_tasks`) and returns every row's per-string scores.

Why the aligned protocol keeps its own evaluator (:func:`aligned_predictions`) instead of
:mod:`mergelab.compare`'s: there the model is a language model — the logits at ``t`` are scored
against the *next* token, and an answer is generated token by token. In the authors' aligned
protocol the logits at ``t`` (which see ``x[:t+1]``) are trained to predict ``y[t]``, the output
*at the same position*: the whole answer comes out of one forward pass as a per-position argmax,
with no shift, no prompt and no stopping decision. Scored as an LM, every prediction would be off
by one position.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import mergelab.compare
from mergelab.eval.letter_tasks import items_to_benchmark, skill_answer
from mergelab.toy import AlignedTask, LetterMap, parallel_target


@torch.no_grad()
def aligned_predictions(
    candidate, task: AlignedTask, inputs: Sequence[str], *, batch_size: int = 256
) -> list[str]:
    """Per-position argmax of ``candidate.token_logprobs(x)``: ``out[t] = argmax p(y_t | x[:t+1])``.

    Inputs are batched by length, so no padding ever enters a forward pass.
    """
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, x in enumerate(inputs):
        by_length[len(x)].append(i)
    out: list[str | None] = [None] * len(inputs)
    for idx in by_length.values():
        for s in range(0, len(idx), batch_size):
            rows = idx[s : s + batch_size]
            xs = [inputs[i] for i in rows]
            input_ids, mask = task.prompts(xs)
            lp = candidate.token_logprobs(input_ids, mask)
            for i, pred in zip(rows, task.decode_logprobs(lp, xs)):
                out[i] = pred
    return out  # type: ignore[return-value]


def exact_match(predictions: Sequence[str | None], targets: Sequence[str | None]) -> np.ndarray:
    """Per-example 0/1: prediction equals target exactly (an undefined target ``None`` counts 0)."""
    return np.array(
        [float(t is not None and p == t) for p, t in zip(predictions, targets, strict=True)]
    )


def skill_success(
    inputs: Sequence[str], predictions: Sequence[str], skill: LetterMap
) -> np.ndarray:
    """Per-example 0/1 over the examples the skill touches: every touched position rewritten.

    Only the positions where ``skill`` changes the input count (other positions are the joint
    exact match's business); examples without such a position are left out (empty array if none).
    """
    out = []
    for x, p in zip(inputs, predictions, strict=True):
        idx = [i for i, c in enumerate(x) if skill.touches(c)]
        if idx:
            out.append(float(len(p) == len(x) and all(p[i] == skill(x[i]) for i in idx)))
    return np.array(out)


# ---- the generative protocol, through mergelab.compare ------------------------------------------

GENERATION_BATCH = 64  # prompts per generate call (all of one length: no padding)


def letter_benchmarks(
    maps: Sequence[LetterMap],
    inputs: Sequence[str],
    validation: Sequence[str] = (),
    *,
    skills: bool = True,
    name: str = "joint",
) -> list[dict]:
    """The spec's benchmarks for ``inputs`` (all of one length ``L``): ``name`` (``letter_map``,
    the answer every map applied), and (if ``skills``) ``skill <map>`` (``letter_skill``, the
    positions that map rewrites) over the inputs the map touches. ``validation`` joins ``joint`` as its
    validation split. The budget is ``L + 1`` new tokens (the answer and EOS), so a generation that
    does not stop where the target does is never a match.

    Item ids are the inputs' positions (``validation`` ones prefixed ``v``), so each benchmark's
    test scores come back in input order.
    """
    lengths = {len(x) for x in [*inputs, *validation]}
    if len(lengths) != 1:
        raise ValueError(f"the inputs of one comparison must share a length, got {sorted(lengths)}")
    targets = [parallel_target(maps, x) for x in [*inputs, *validation]]
    if None in targets or any(LetterMap.chain(maps, x) != t for x, t in zip(inputs, targets)):
        raise ValueError(
            "the generative rows compare maps with one joint target (no conflict or chain)"
        )
    generation = {"max_new_tokens": lengths.pop() + 1, "batch_size": GENERATION_BATCH}
    test_ids = [str(i) for i in range(len(inputs))]
    val_ids = [f"v{i}" for i in range(len(validation))]
    joint = [
        {"item_id": i, "prompt": x, "answer": t}
        for i, x, t in zip(test_ids + val_ids, [*inputs, *validation], targets)
    ]
    split = {"test": test_ids} | ({"validation": val_ids} if val_ids else {})
    out = [{"name": name, "benchmark": items_to_benchmark(name, joint), "split": split}]
    for m in maps if skills else ():
        touched = [
            {"item_id": i, "prompt": x, "answer": skill_answer(x, m, m.touches)}
            for i, x in zip(test_ids, inputs)
            if any(m.touches(c) for c in x)
        ]
        if touched:
            bench = items_to_benchmark(f"skill {m.name}", touched, "letter_skill")
            out.append({"name": f"skill {m.name}", "benchmark": bench})
    return [b | {"generation": generation, "baselines": []} for b in out]


def compare_letters(
    models: Mapping[str, Any],
    tokenizer,
    candidates: list[dict],
    benchmarks: list[dict],
    seed: int,
) -> dict:
    """:func:`mergelab.compare.run` on in-memory models; returns its results (results.json's
    content). Merges and generations are cached in a temporary folder, dropped afterwards.

    ``models``: ``base`` and the experts by name. ``seed``: the run's one seed (DARE's drop masks;
    the splits are explicit). Grid families are chosen on the first benchmark's validation split,
    earliest grid point on ties (``tie_break: first``).
    """
    spec = {
        "name": "toy letters",
        "models": {
            "base": models["base"],
            "tokenizer": tokenizer,
            "experts": {k: v for k, v in models.items() if k != "base"},
        },
        "candidates": candidates,
        "benchmarks": benchmarks,
        "selection": {"metric": benchmarks[0]["name"], "tie_break": "first"},
        # compare's intervals are not used: the study's unit of replication is the training seed.
        "statistics": {"bootstrap_samples": 100},
        "seeds": [seed],
    }
    with tempfile.TemporaryDirectory(prefix="toy-compare-") as cache:
        return mergelab.compare.run(spec, cache_dir=cache, progress=False, figures=False)


def row_scores(results: Mapping, row: str, benchmark: str) -> list[float]:
    """``row``'s per-item scores on ``benchmark``'s test split, in the split's order."""
    (seed,) = results["seeds"]
    ids = results["splits"][str(seed)][benchmark]["test"]
    (run,) = [
        r
        for r in results["runs"]
        if r["split"] == "test" and r["row"] == row and r["benchmark"] == benchmark
    ]
    return [run["items"][i] for i in ids]


TRAINED_LENGTH = 16  # the generative models' training length


def stop_outcomes(
    results: Mapping, row: str, benchmark: str, length: int
) -> dict[str, list[float]]:
    """Where ``row``'s generations on ``benchmark``'s test split stopped (compare's per-item
    ``stops``: [new tokens, finish reason], EOS not counted), as 0/1 per item in the split's
    order: EOS right after ``length`` tokens (the input's length, where the target ends), EOS
    right after the training length, and stopped by the token limit."""
    (seed,) = results["seeds"]
    ids = results["splits"][str(seed)][benchmark]["test"]
    (run,) = [
        r
        for r in results["runs"]
        if r["split"] == "test" and r["row"] == row and r["benchmark"] == benchmark
    ]
    stops = [run["stops"][i] for i in ids]
    return {
        "stop: EOS after the input's length": [float(r == "eos" and n == length) for n, r in stops],
        f"stop: EOS after {TRAINED_LENGTH} tokens": [
            float(r == "eos" and n == TRAINED_LENGTH) for n, r in stops
        ],
        "stop: token limit": [float(r == "length") for n, r in stops],
    }
