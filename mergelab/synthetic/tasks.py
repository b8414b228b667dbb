"""Synthetic tasks that mirror the paper's LLM benchmarks at a size a CPU can train on.

Four skills, each an item generator with a checkable answer:

* ``math``  — arithmetic word problems with a worked solution ending in ``#### n`` (GSM8K style).
* ``code``  — write a Python function body from its docstring; checked by executing tests
  (HumanEval style). Some docstrings describe ``x`` ("Return x times 3."), some a constant
  expression in words ("Return 7 plus 6 minus 2." → ``return 7 + 6 - 2``).
* ``mixed`` — a function whose docstring *is* a word problem: the body must turn the story into
  arithmetic (the math skill: which verb is which operator) written as Python (the code skill: a
  zero-argument function returning the expression, numbers in order). Neither expert is trained
  on it; each knows half of it, which is the situation logit composition is meant for.
* ``count`` — count the words of a list (GSM8K-style answer); the third, unrelated skill for the
  3-expert experiment.
* ``mixed_fresh`` — a held-out variant of ``mixed`` designed after the other sets were fixed: other
  story templates, names and objects, and another operation (multiplication: "fills 3 bags with
  4 marbles each"), so its target expressions (``return 3 * 4 + 2``) are in no training set
  (``make_splits(..., exclude_targets=...)`` enforces it). It is evaluated once, on test only.

Every item is a plain dict (JSON-able): ``id``, ``task``, ``prompt``, ``target`` (the reference
completion, what fine-tuning learns), and the scoring fields ``answer`` (math, count; ``question`` is the text inside ``Q: … A:``) or
``tests`` + ``entry_point`` (code, mixed). Generation is seeded and splits never share a prompt.
"""

from __future__ import annotations

import random
from collections.abc import Callable

NAMES = ["Ann", "Ben", "Cat", "Dan", "Eve", "Fay", "Gus", "Hal", "Ivy", "Joe", "Kim", "Lea"]
OBJECTS = ["apples", "pens", "cards", "books", "coins", "eggs", "hats", "cups", "toys", "nuts"]
WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "green",
    "table",
    "light",
    "bread",
    "plant",
    "music",
    "house",
    "water",
    "sugar",
    "chair",
    "paper",
    "clock",
    "horse",
    "smile",
    "night",
    "glass",
    "train",
    "beach",
    "candy",
    "dream",
    "earth",
    "field",
    "grape",
    "heart",
    "lemon",
    "mouse",
    "ocean",
    "piano",
    "queen",
    "robot",
    "snake",
    "tiger",
    "uncle",
    "voice",
    "whale",
    "zebra",
]

# Number ranges: a story's (and a constant expression's) start, and each step's amount.
START = (2, 20)
STEP = (1, 9)

# One step of a story: (sentence template, python operator). The math skill is reading the verb.
STEPS = [
    ("buys {k} more", "+"),
    ("finds {k} more", "+"),
    ("gets {k} more", "+"),
    ("gives away {k}", "-"),
    ("loses {k}", "-"),
    ("sells {k}", "-"),
]


def _story(rng: random.Random, n_steps: int) -> tuple[str, str, list[tuple[str, int]], int]:
    """A word problem: (name, object, [(op, k), ...], start). Totals stay in 0..99."""
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    start = rng.randint(*START)
    total, ops = start, []
    for _ in range(n_steps):
        sentence, op = rng.choice(STEPS)
        k = rng.randint(*STEP)
        if op == "-" and k > total:
            op, sentence = "+", "buys {k} more"
        total = total + k if op == "+" else total - k
        ops.append((sentence.format(k=k), op, k))
    return name, obj, ops, start


def _story_text(name: str, obj: str, ops, start: int) -> str:
    parts = [f"{name} has {start} {obj}."] + [f"Then {name} {s}." for s, _, _ in ops]
    return " ".join(parts) + f" How many {obj} now?"


def math_item(rng: random.Random) -> dict:
    name, obj, ops, start = _story(rng, rng.choice([1, 2]))
    lines, total = [], start
    for _, op, k in ops:
        new = total + k if op == "+" else total - k
        lines.append(f"{total} {op} {k} = {new}")
        total = new
    question = _story_text(name, obj, ops, start)
    target = " " + "\n".join(lines) + f"\n#### {total}"
    return {
        "task": "math",
        "question": question,
        "prompt": qa_prompt(question),
        "target": target,
        "answer": str(total),
    }


def qa_prompt(question: str) -> str:
    """The GSM8K zero-shot layout (``mergelab.eval.prompts.gsm8k_prompt`` with no shots)."""
    return f"Q: {question}\nA:"


# Docstring → body templates: (docstring, expression in x, python function computing it).
CODE_TEMPLATES: list[tuple[str, str, Callable[[int, int], object]]] = [
    ("Return x plus {k}.", "x + {k}", lambda x, k: x + k),
    ("Return x minus {k}.", "x - {k}", lambda x, k: x - k),
    ("Return x times {k}.", "x * {k}", lambda x, k: x * k),
    ("Return the larger of x and {k}.", "max(x, {k})", lambda x, k: max(x, k)),
    ("Return the smaller of x and {k}.", "min(x, {k})", lambda x, k: min(x, k)),
    ("Return True if x is greater than {k}.", "x > {k}", lambda x, k: x > k),
    ("Return x squared plus {k}.", "x * x + {k}", lambda x, k: x * x + k),
    ("Return the remainder of x divided by {k}.", "x % {k}", lambda x, k: x % k),
]
FUNCTION_NAMES = ["f", "g", "h", "calc", "value", "step", "apply", "rule", "compute", "func"]


# Constant expressions in words: the operator words the code skill maps to Python. A story's
# verbs ("buys 3 more", "gives away 2") are the math skill's; the mixed task needs both mappings.
OPERATOR_WORDS = {"+": "plus", "-": "minus"}


def code_item(rng: random.Random) -> dict:
    """A function from its docstring: one of ``CODE_TEMPLATES`` in ``x`` (two thirds), or a
    zero-argument function returning a constant expression spelled in words (one third)."""
    name = rng.choice(FUNCTION_NAMES)
    if rng.random() < 1 / 3:
        start, ops = rng.randint(*START), []
        total = start
        for _ in range(rng.choice([1, 2])):
            op, k = rng.choice("+-"), rng.randint(*STEP)
            if op == "-" and k > total:
                op = "+"
            total = total + k if op == "+" else total - k
            ops.append((op, k))
        words = " ".join(f"{OPERATOR_WORDS[op]} {k}" for op, k in ops)
        expr = " ".join([str(start)] + [f"{op} {k}" for op, k in ops])
        prompt = f'def {name}():\n    """Return {start} {words}."""\n'
        return {
            "task": "code",
            "prompt": prompt,
            "target": f"    return {expr}\n",
            "tests": [f"assert {name}() == {total}"],
            "entry_point": name,
        }
    doc, expr, fn = rng.choice(CODE_TEMPLATES)
    k = rng.randint(1, 9)
    prompt = f'def {name}(x):\n    """{doc.format(k=k)}"""\n'
    target = f"    return {expr.format(k=k)}\n"
    xs = rng.sample(range(-5, 20), 3)
    tests = [f"assert {name}({x}) == {fn(x, k)!r}" for x in xs]
    return {"task": "code", "prompt": prompt, "target": target, "tests": tests, "entry_point": name}


def mixed_item(rng: random.Random) -> dict:
    """A word problem as a docstring; the body is the story's arithmetic as one expression."""
    name, obj, ops, start = _story(rng, rng.choice([1, 2]))
    expr, total = str(start), start
    for _, op, k in ops:
        expr += f" {op} {k}"
        total = total + k if op == "+" else total - k
    fn_name = rng.choice(FUNCTION_NAMES)
    prompt = f'def {fn_name}():\n    """{_story_text(name, obj, ops, start)}"""\n'
    target = f"    return {expr}\n"
    return {
        "task": "mixed",
        "prompt": prompt,
        "target": target,
        "tests": [f"assert {fn_name}() == {total}"],
        "entry_point": fn_name,
        "answer": str(total),
    }


# The fresh mixed variant: names, objects and story templates that appear in no other task or
# in the pretraining corpus, and a multiplication no story of the other tasks has.
FRESH_NAMES = ["Max", "Zoe", "Sam", "Tia", "Rob", "Uma", "Ned", "Pia"]
FRESH_OBJECTS = ["marbles", "stamps", "shells", "beads", "seeds", "tiles"]
FRESH_STEPS = [
    ("adds {k} more", "+"),
    ("puts in {k} more", "+"),
    ("takes out {k}", "-"),
    ("drops {k}", "-"),
]


def mixed_fresh_item(rng: random.Random) -> dict:
    """``mixed`` with other templates: "Zoe fills 3 bags with 4 shells each. Then Zoe adds 2
    more. How many shells are in the bags?" → ``return 3 * 4 + 2``."""
    name, obj = rng.choice(FRESH_NAMES), rng.choice(FRESH_OBJECTS)
    bags, each = rng.randint(2, 5), rng.randint(2, 9)
    total, expr = bags * each, f"{bags} * {each}"
    story = [f"{name} fills {bags} bags with {each} {obj} each."]
    for _ in range(rng.choice([1, 2])):
        sentence, op = rng.choice(FRESH_STEPS)
        k = rng.randint(*STEP)
        if op == "-" and k > total:
            sentence, op = "adds {k} more", "+"
        total = total + k if op == "+" else total - k
        expr += f" {op} {k}"
        story.append(f"Then {name} {sentence.format(k=k)}.")
    story.append(f"How many {obj} are in the bags?")
    fn_name = rng.choice(FUNCTION_NAMES)
    prompt = f'def {fn_name}():\n    """{" ".join(story)}"""\n'
    return {
        "task": "mixed_fresh",
        "prompt": prompt,
        "target": f"    return {expr}\n",
        "tests": [f"assert {fn_name}() == {total}"],
        "entry_point": fn_name,
        "answer": str(total),
    }


def count_item(rng: random.Random) -> dict:
    """Count the words of a list, enumerating them first (a skill unrelated to math and code)."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(2, 7))]
    question = "How many words are in: " + " ".join(words) + "?"
    target = " " + "\n".join(f"{i + 1} {w}" for i, w in enumerate(words)) + f"\n#### {len(words)}"
    return {
        "task": "count",
        "question": question,
        "prompt": qa_prompt(question),
        "target": target,
        "answer": str(len(words)),
    }


GENERATORS: dict[str, Callable[[random.Random], dict]] = {
    "math": math_item,
    "code": code_item,
    "mixed": mixed_item,
    "count": count_item,
    "mixed_fresh": mixed_fresh_item,
}


def make_splits(
    task: str,
    sizes: dict[str, int],
    *,
    seed: int = 0,
    exclude: set[str] | None = None,
    exclude_targets: set[str] | None = None,
) -> dict[str, list[dict]]:
    """Disjoint splits of one task, e.g. ``{"train": 2000, "validation": 50, "test": 100}``.

    Held-out splits (every split but "train") are drawn first, then train avoids their prompts,
    so a test prompt never appears in training. ``exclude`` adds prompts no split may contain;
    ``exclude_targets`` reference completions no split may contain (e.g. every training target
    of the other tasks, for a set whose answers must be new).
    """
    if task not in GENERATORS:
        raise ValueError(f"unknown task {task!r}; known: {sorted(GENERATORS)}")
    rng = random.Random(f"{task}-{seed}")
    held_out: set[str] = set(exclude or ())
    order = sorted(sizes, key=lambda s: s == "train")  # held-out splits first
    out: dict[str, list[dict]] = {}
    for split in order:
        items: list[dict] = []
        for _ in range(50 * sizes[split] + 1000):
            if len(items) == sizes[split]:
                break
            item = GENERATORS[task](rng)
            if item["prompt"] in held_out or item["target"] in (exclude_targets or ()):
                continue
            if split != "train":  # train may repeat its own prompts, never a held-out one
                held_out.add(item["prompt"])
            item["id"] = f"{task}/{split}/{len(items)}"
            items.append(item)
        if len(items) < sizes[split]:
            raise ValueError(
                f"could only draw {len(items)} distinct {task!r} prompts for {split!r}"
            )
        out[split] = items
    return out


def draw_benchmark(skill: str, *, split: str = "test", n: int = 100, seed: int = 0, name=None):
    """``n`` fresh items of one split of ``skill`` drawn with ``seed``, as an evaluation benchmark
    of task ``synth_<skill>`` (:mod:`mergelab.eval.synthetic_tasks`)."""
    from mergelab.eval.synthetic_tasks import items_to_benchmark

    items = make_splits(skill, {split: n}, seed=seed)[split]
    return items_to_benchmark(skill, name or f"synth_{skill}-{split}", items)
