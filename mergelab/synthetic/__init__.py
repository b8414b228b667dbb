"""Synthetic tasks, a pretraining corpus and a char-level tokenizer for the mini-scale LLM study."""

from .corpus import pretraining_corpus
from .tasks import GENERATORS, draw_benchmark, make_splits
from .tokenizer import mini_tokenizer

__all__ = ["GENERATORS", "draw_benchmark", "make_splits", "mini_tokenizer", "pretraining_corpus"]
