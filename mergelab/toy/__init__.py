"""Toy compositional tasks with exact targets (arXiv 2605.28304; docs/composition.md §4).

What stays in the library is what a user testing a merge or a composition on their own tiny
models imports: string transformations whose joint target is known exactly, and the two ways of
posing them to a causal LM. Training recipes, evaluation and the study's metrics live with the
study (``studies/toy/``).

* :mod:`.tokenizer` — the toy alphabet (space + A–Z, optional markers, pad/eos/sep) as a
  transformers ``PreTrainedTokenizerFast`` built offline.
* :mod:`.tasks` — letter maps (replacement, chains, conflicts) with their parallel and chained
  joint targets, span skills with stopping times, and the aligned / generative encoders.
"""

from .tasks import (
    AlignedTask,
    GenerativeTask,
    LetterMap,
    SpanExample,
    SpanSkillTask,
    parallel_target,
    random_strings,
)
from .tokenizer import ALPHABET, LETTERS, build_char_tokenizer

__all__ = [
    "ALPHABET",
    "LETTERS",
    "AlignedTask",
    "GenerativeTask",
    "LetterMap",
    "SpanExample",
    "SpanSkillTask",
    "build_char_tokenizer",
    "parallel_target",
    "random_strings",
]
