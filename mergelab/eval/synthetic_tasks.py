"""The mini LLM study's synthetic tasks as evaluation tasks. The items themselves are study data,
drawn by :mod:`mergelab.synthetic` (``mergelab.synthetic.draw_benchmark``); this module only says
how they are prompted and scored, and reads them from memory or a JSONL file of those records.

* ``synth_math``, ``synth_count`` — "Q: … A:" prompts (no shots: the experts were trained on
  exactly this layout), scored **strictly**: only a final ``#### n`` line counts, so a number
  that merely appears in the text (the count task enumerates "1 apple 2 river …") is not an
  answer.
* ``synth_code``, ``synth_mixed``, ``synth_mixed_fresh`` — complete the function stub; the
  item's asserts are run in the sandbox.

Baseline ``sum_of_numbers`` (``synth_math``, ``synth_mixed``, ``synth_mixed_fresh``): add the
numbers that appear in the question — ``#### <sum>``, or a function body returning the sum — a
floor a model must beat to show it reads the story rather than adds what it sees.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from mergelab.eval.benchmarks import Benchmark, CodeTests, Item, read_records
from mergelab.eval.prompts import GSM8K_STOPS, code_stop_strings, gsm8k_prompt
from mergelab.eval.scoring_code import score_code
from mergelab.eval.scoring_math import answer_scorer, final_line_correct
from mergelab.eval.tasks import Task, register_task

_NUMBER = re.compile(r"-?\d+")


def _question_numbers(text: str) -> list[int]:
    return [int(n) for n in _NUMBER.findall(text)]


def sum_of_numbers_answer(item: Item) -> str:
    """``#### <sum of the numbers in the question>``."""
    return f" #### {sum(_question_numbers(item.prompt))}"


def sum_of_numbers_program(item: Item) -> str:
    """A body returning the sum of the numbers in the function's docstring."""
    docstring = item.prompt.split('"""')[1] if item.prompt.count('"""') >= 2 else item.prompt
    return f"    return {sum(_question_numbers(docstring))}\n"


def items_to_benchmark(skill: str, name: str, items: Sequence[dict]) -> Benchmark:
    """A benchmark of ``synth_<skill>`` from items of :func:`mergelab.synthetic.make_splits`."""
    task = f"synth_{skill}"
    if get_kind(skill) == "code":
        built = [
            Item(
                it["id"],
                it["prompt"],
                answer=it.get("answer"),
                solution=it["target"],
                tests=CodeTests(entry_point=it["entry_point"], asserts=tuple(it["tests"])),
            )
            for it in items
        ]
    else:
        built = [
            Item(it["id"], it["question"], answer=it["answer"], solution=it["target"])
            for it in items
        ]
    return Benchmark(name, task, built, source="synthetic")


def get_kind(skill: str) -> str:
    return "code" if skill in ("code", "mixed", "mixed_fresh") else "math"


def _loader(skill: str):
    def load(
        items: Sequence[dict] | str | os.PathLike,
        limit: int | None = None,
        *,
        name: str | None = None,
    ) -> Benchmark:
        """Items as :func:`mergelab.synthetic.make_splits` draws them: in memory, or a JSONL /
        JSON list file of those records."""
        if isinstance(items, (str, os.PathLike)):
            source = Path(items)
            items = [rec for _, rec in read_records(source)]
            name = name or f"synth_{skill}-{source.stem}"
        bench = items_to_benchmark(skill, name or f"synth_{skill}", items)
        return bench.head(limit)

    return load


def _qa_prompt(item: Item, config) -> str:
    return gsm8k_prompt(item.prompt, config)  # "Q: …\nA:" with no shots: the experts' layout


_strict = answer_scorer(lambda text, item, settings: final_line_correct(text, item.answer))

for _skill, _baselines in [
    ("math", {"sum_of_numbers": sum_of_numbers_answer}),
    ("count", {}),
    ("code", {}),
    ("mixed", {"sum_of_numbers": sum_of_numbers_program}),
    ("mixed_fresh", {"sum_of_numbers": sum_of_numbers_program}),
]:
    if get_kind(_skill) == "code":
        register_task(
            Task(
                name=f"synth_{_skill}",
                kind="code",
                load=_loader(_skill),
                build_prompt=lambda item, config: item.prompt,
                score=score_code,
                baselines=_baselines,
                stop_strings=code_stop_strings,
                description=f"synthetic {_skill}: complete the function, run its asserts",
            )
        )
    else:
        register_task(
            Task(
                name=f"synth_{_skill}",
                kind="math",
                load=_loader(_skill),
                build_prompt=_qa_prompt,
                score=_strict,
                baselines=_baselines,
                stop_strings=lambda bench: GSM8K_STOPS,
                description=f"synthetic {_skill}: 'Q: … A:', only a final '#### n' line counts",
            )
        )
