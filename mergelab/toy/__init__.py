"""Toy compositional tasks on tiny GPT-2 models (arXiv 2605.28304; docs/composition.md §4).

Components only; the recipes that run the studies are ``studies/toy_*.py``.

* :mod:`.tokenizer` — a character tokenizer (A–Z, space, optional markers, pad/eos/sep) built
  offline as a transformers ``PreTrainedTokenizerFast``.
* :mod:`.tasks` — letter maps (replacement, chains, conflicts), span skills with stopping times,
  and the two ways of posing a string transformation to a causal LM (aligned / generative).
* :mod:`.train` — tiny GPT-2 from a ``GPT2Config``, a short AdamW loop, LoRA fine-tuning.
* :mod:`.metrics` — exact match of the joint transformation, per-skill success, bootstrap CIs.
"""

from .metrics import exact_match, seed_bootstrap_ci, skill_success
from .tasks import (
    AlignedTask,
    GenerativeTask,
    LetterMap,
    SpanSkillTask,
    parallel_target,
    random_strings,
)
from .tokenizer import LETTERS, build_char_tokenizer
from .train import TrainConfig, finetune_lora, tiny_gpt2, train_model

__all__ = [
    "LETTERS",
    "AlignedTask",
    "GenerativeTask",
    "LetterMap",
    "SpanSkillTask",
    "TrainConfig",
    "seed_bootstrap_ci",
    "build_char_tokenizer",
    "exact_match",
    "finetune_lora",
    "parallel_target",
    "random_strings",
    "skill_success",
    "tiny_gpt2",
    "train_model",
]
