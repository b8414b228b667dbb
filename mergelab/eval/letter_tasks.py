"""The toy letter-replacement task (:mod:`mergelab.toy.tasks`) as an evaluation task.

``letter_map`` — an item's ``prompt`` is a string over the toy alphabet (space, A–Z) and its
``answer`` the rewritten string (e.g. every ``A`` turned into ``B``). The prompt given to the
model is the string followed by the separator, ``x[SEP]``: the generative protocol
(``x [SEP] y [EOS]``) the toy models are trained with (:class:`mergelab.toy.tasks.GenerativeTask`).
Scored by **exact match**: the generated text up to the first ``[EOS]`` must equal the answer,
character for character (spaces included), and the generation must have ended (an EOS token, a
stop string, or ``[EOS]`` in the text) rather than run into ``max_new_tokens``. A generation with
more tokens than characters holds a special token (``[SEP]``, ``[PAD]``) that decoding dropped
from its text: never a match (every other toy token is one character).

``letter_skill`` — one skill's share of the job: the same prompt, and an ``answer`` that gives
the rewritten letter at each position the skill touches and ``?`` everywhere else. Correct when
the generation ended as above, has the input's length, and agrees with the answer at every
position that is not ``?`` (what the other skill writes elsewhere is not this skill's business).

Kind ``"math"``: the harness branches on a task's kind only for ``"code"`` (chat instruction
asking for a fenced block, tests run in the sandbox); every other task is an answer task, an answer
compared with a reference, which this is. The toy tokenizer has no chat template, so the prompt
is used as it is.

Baseline ``copy``: the input string unchanged — what the copying base is trained to do; it scores
0 on any set whose every string needs a rewrite.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mergelab.eval.benchmarks import Benchmark, Item, read_records
from mergelab.eval.scoring_math import answer_scorer
from mergelab.eval.tasks import Task, register_task

SEPARATOR = "[SEP]"  # mergelab.toy.tokenizer's sep token
END = "[EOS]"  # its eos token


def letter_prompt(item: Item, config: Any = None) -> str:
    """``x[SEP]``: the string, then the separator the toy models were trained with."""
    return item.prompt + SEPARATOR


def generated_string(text: str) -> str:
    """The generated text up to the first ``[EOS]`` (all of it when there is none)."""
    return text.split(END, 1)[0]


def letter_correct(
    text: str, answer: str | None, finish_reason: str = "eos", n_tokens: int | None = None
) -> bool:
    """Exact match of the generated string with ``answer``; a generation cut by the token limit
    (``finish_reason == "length"``) counts only if ``[EOS]`` appears in its text. ``n_tokens``
    (the generated ids, EOS excluded; None: not known): more tokens than characters means a
    special token was decoded to nothing, and the generation does not match."""
    return (
        _ended_cleanly(text, answer, finish_reason, n_tokens) and generated_string(text) == answer
    )


def _ended_cleanly(text: str, answer: str | None, finish_reason: str, n_tokens: int | None) -> bool:
    if answer is None:
        raise ValueError("letter items need an answer")
    if finish_reason == "length" and END not in text:
        return False
    # Ended at EOS with more tokens than characters: a special token decoded to nothing.
    return finish_reason != "eos" or n_tokens is None or n_tokens <= len(text)


WILDCARD = "?"  # a position of a letter_skill answer that is not scored


def skill_correct(
    text: str, answer: str | None, finish_reason: str = "eos", n_tokens: int | None = None
) -> bool:
    """``letter_skill``: the generated string has the answer's length and agrees with it at every
    position that is not ``?``; the generation must have ended as for :func:`letter_correct`."""
    if not _ended_cleanly(text, answer, finish_reason, n_tokens):
        return False
    out = generated_string(text)
    return len(out) == len(answer) and all(a in (WILDCARD, o) for o, a in zip(out, answer))


def _record_check(correct: Callable[..., bool]):
    """``answer_scorer``'s check from a verdict on (text, answer, finish_reason, n_tokens)."""

    def check(rec: Mapping[str, Any], item: Item, settings: Any) -> tuple[bool, str]:
        text = rec["text"]
        ok = correct(text, item.answer, rec["finish_reason"], rec.get("n_tokens"))
        return ok, generated_string(text)

    return check


# Per item, accuracy = the fraction of its samples that match exactly (letter_map) or are right
# at every scored position (letter_skill).
score_letter_map = answer_scorer(_record_check(letter_correct), whole_record=True)
score_letter_skill = answer_scorer(_record_check(skill_correct), whole_record=True)


def items_to_benchmark(
    name: str, records: Sequence[Mapping[str, Any]], task: str = "letter_map"
) -> Benchmark:
    """A ``letter_map`` (or ``letter_skill``) benchmark from records with ``item_id``, ``prompt``
    and ``answer`` (a ``letter_skill`` answer has the prompt's length)."""
    if task not in ("letter_map", "letter_skill"):
        raise ValueError(f"task must be letter_map or letter_skill, got {task!r}")
    items = []
    for i, rec in enumerate(records):
        missing = [k for k in ("prompt", "answer") if not isinstance(rec.get(k), str)]
        if missing:
            raise ValueError(f"{task} item {i}: missing or non-string {missing}")
        if task == "letter_skill" and len(rec["answer"]) != len(rec["prompt"]):
            raise ValueError(f"letter_skill item {i}: the answer is not as long as the prompt")
        items.append(Item(str(rec.get("item_id", i)), rec["prompt"], answer=rec["answer"]))
    return Benchmark(name, task, items, source=task.replace("_", "-"))


def skill_answer(x: str, rewrite: Callable[[str], str], touches: Callable[[str], bool]) -> str:
    """A ``letter_skill`` answer: ``rewrite(c)`` where ``touches(c)``, ``?`` elsewhere."""
    return "".join(rewrite(c) if touches(c) else WILDCARD for c in x)


def load_letter_map(
    path: str | os.PathLike, limit: int | None = None, *, name: str | None = None
) -> Benchmark:
    """Items from a JSONL (or JSON list) file of ``{item_id, prompt, answer}`` records."""
    records = [rec for _, rec in read_records(path)]
    bench = items_to_benchmark(name or f"letter_map-{os.path.basename(os.fspath(path))}", records)
    bench.source = os.fspath(path)
    return bench.head(limit)


def load_letter_skill(
    path: str | os.PathLike, limit: int | None = None, *, name: str | None = None
) -> Benchmark:
    """Items from a JSONL (or JSON list) file of ``{item_id, prompt, answer}`` records."""
    records = [rec for _, rec in read_records(path)]
    bench = items_to_benchmark(
        name or f"letter_skill-{os.path.basename(os.fspath(path))}", records, "letter_skill"
    )
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

register_task(
    Task(
        name="letter_skill",
        kind="math",
        load=load_letter_skill,
        build_prompt=letter_prompt,
        score=score_letter_skill,
        baselines={"copy": copy_input},
        description="toy letter replacement, one skill: the positions it rewrites ('?' elsewhere)",
    )
)
