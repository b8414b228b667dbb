"""A small mixed pretraining corpus for the mini-scale base model.

It teaches the *ingredients* the tasks are written in — stories about people and objects,
arithmetic equations, Python functions, English words — but never a task's format paired with its
solution: no "Q: … A: … #### n", no docstring followed by its body, no enumerated word count.
So the base knows the language and is weak at every task (as gemma-2-2b is weak at GSM8K and
HumanEval+ before fine-tuning), and each expert has a skill to add.
"""

from __future__ import annotations

import random

from . import tasks
from .tasks import CODE_TEMPLATES, FUNCTION_NAMES, NAMES, OBJECTS, STEPS, WORDS


def _story_doc(rng: random.Random) -> str:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    parts = [f"{name} has {rng.randint(*tasks.START)} {obj}."]
    for _ in range(rng.randint(1, 3)):
        parts.append(f"Then {name} {rng.choice(STEPS)[0].format(k=rng.randint(*tasks.STEP))}.")
    if rng.random() < 0.3:
        parts.append(f"How many {obj} now?")
    return " ".join(parts)


def _equation_doc(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(2, 5)):
        a, b = rng.randint(0, 30), rng.randint(1, 9)
        op = rng.choice("+-*")
        lines.append(f"{a} {op} {b} = {eval(f'{a} {op} {b}')}")  # noqa: S307 (two literals)
    return "\n".join(lines)


def _code_doc(rng: random.Random) -> str:
    funcs = []
    for _ in range(rng.randint(1, 2)):
        name = rng.choice(FUNCTION_NAMES)
        if rng.random() < 0.3:  # a constant expression, without the words that describe it
            terms = [str(rng.randint(*tasks.START))]
            terms += [
                f"{rng.choice('+-')} {rng.randint(*tasks.STEP)}" for _ in range(rng.randint(1, 2))
            ]
            funcs.append(f"def {name}():\n    return {' '.join(terms)}\n")
            continue
        _, expr, _ = rng.choice(CODE_TEMPLATES)
        funcs.append(f"def {name}(x):\n    return {expr.format(k=rng.randint(1, 9))}\n")
    return "\n".join(funcs)


def _docstring_doc(rng: random.Random) -> str:
    """Docstrings on their own (the words of the code task, without their bodies)."""
    doc, _, _ = rng.choice(CODE_TEMPLATES)
    return f'"""{doc.format(k=rng.randint(1, 9))}"""'


def _words_doc(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))


KINDS = {
    "story": _story_doc,
    "equations": _equation_doc,
    "code": _code_doc,
    "docstring": _docstring_doc,
    "words": _words_doc,
}


def pretraining_corpus(n_docs: int, *, seed: int = 0) -> list[str]:
    """``n_docs`` documents, kinds drawn uniformly; deterministic in ``seed``."""
    rng = random.Random(f"corpus-{seed}")
    kinds = list(KINDS.values())
    return [rng.choice(kinds)(rng) for _ in range(n_docs)]
