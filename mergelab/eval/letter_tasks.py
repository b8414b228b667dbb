"""The toy letter-replacement task (:mod:`mergelab.toy.tasks`) as an evaluation task.

``letter_map`` — an item's ``prompt`` is a string over the toy alphabet (space, A–Z) and its
``answer`` the rewritten string (e.g. every ``A`` turned into ``B``). The prompt given to the
model is the string followed by the separator, ``x[SEP]``: the generative protocol
(``x [SEP] y [EOS]``) the toy models are trained with (:class:`mergelab.toy.tasks.GenerativeTask`).
Scored by **exact match**: the generated text up to the first ``[EOS]`` must equal the answer,
character for character (spaces included), and the generation must have ended (an EOS token, a
stop string, or ``[EOS]`` in the text) rather than run into ``max_new_tokens``.

Kind ``"math"``: the harness branches on a task's kind only for ``"code"`` (chat instruction
asking for a fenced block, tests run in the sandbox); every other task is an answer task, an answer
compared with a reference, which this is. The toy tokenizer has no chat template, so the prompt
is used as it is.

Baseline ``copy``: the input string unchanged — what the copying base is trained to do; it scores
0 on any set whose every string needs a rewrite.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from mergelab.eval.benchmarks import Benchmark, Item, read_records
from mergelab.eval.tasks import Task, TaskScores, register_task

SEPARATOR = "[SEP]"  # mergelab.toy.tokenizer's sep token
END = "[EOS]"  # its eos token


def letter_prompt(item: Item, config: Any = None) -> str:
    """``x[SEP]``: the string, then the separator the toy models were trained with."""
    return item.prompt + SEPARATOR


def generated_string(text: str) -> str:
    """The generated text up to the first ``[EOS]`` (all of it when there is none)."""
    return text.split(END, 1)[0]


def letter_correct(text: str, answer: str | None, finish_reason: str = "eos") -> bool:
    """Exact match of the generated string with ``answer``; a generation cut by the token limit
    (``finish_reason == "length"``) counts only if ``[EOS]`` appears in its text."""
    if answer is None:
        raise ValueError("letter_map items need an answer")
    if finish_reason == "length" and END not in text:
        return False
    return generated_string(text) == answer


def score_letter_map(benchmark, samples, settings, *, sandbox=None, progress=False):
    """Per item, accuracy = the fraction of its samples that match exactly (the task's scorer)."""
    items, per_item = [], []
    for it in benchmark.items:
        recs = []
        for rec in samples[it.item_id]:
            ok = letter_correct(rec["text"], it.answer, rec["finish_reason"])
            recs.append({"text": rec["text"], "finish_reason": rec["finish_reason"],
                         "extracted": generated_string(rec["text"]), "correct": ok})  # fmt: skip
        acc = sum(r["correct"] for r in recs) / len(recs)
        per_item.append(acc)
        items.append({"item_id": it.item_id, "reference": it.answer,
                      "scores": {"accuracy": acc}, "samples": recs})  # fmt: skip
    return TaskScores(items, {"accuracy": per_item}, "accuracy")


def items_to_benchmark(name: str, records: Sequence[Mapping[str, Any]]) -> Benchmark:
    """A ``letter_map`` benchmark from records with ``item_id``, ``prompt`` and ``answer``."""
    items = []
    for i, rec in enumerate(records):
        missing = [k for k in ("prompt", "answer") if not isinstance(rec.get(k), str)]
        if missing:
            raise ValueError(f"letter_map item {i}: missing or non-string {missing}")
        items.append(Item(str(rec.get("item_id", i)), rec["prompt"], answer=rec["answer"]))
    return Benchmark(name, "letter_map", items, source="letter-map")


def load_letter_map(
    path: str | os.PathLike, limit: int | None = None, *, name: str | None = None
) -> Benchmark:
    """Items from a JSONL (or JSON list) file of ``{item_id, prompt, answer}`` records."""
    records = [rec for _, rec in read_records(path)]
    bench = items_to_benchmark(name or f"letter_map-{os.path.basename(os.fspath(path))}", records)
    bench.source = os.fspath(path)
    return bench.head(limit)


def copy_input(item: Item) -> str:
    """The ``copy`` baseline: the input string unchanged."""
    return item.prompt


register_task(
    Task(
        name="letter_map",
        kind="math",
        load=load_letter_map,
        build_prompt=letter_prompt,
        score=score_letter_map,
        baselines={"copy": copy_input},
        description="toy letter replacement: 'x[SEP]', exact match of the string before [EOS]",
    )
)
