"""Weight-space merges: a registry of per-tensor methods and engines that apply them."""

from . import methods, methods_mergekit, ops  # noqa: F401  (importing registers the methods)
from .registry import (
    MergeMethod,
    TensorContext,
    UnknownMergeMethodError,
    get_merge_method,
    list_merge_methods,
    merge_method,
    unregister_merge_method,
)
from .state_dict import merge_models, merge_state_dicts
from .validation import VOCAB_PADDING_RULES, MergeInputError

__all__ = [
    "MergeInputError",
    "MergeMethod",
    "TensorContext",
    "UnknownMergeMethodError",
    "VOCAB_PADDING_RULES",
    "get_merge_method",
    "list_merge_methods",
    "merge_method",
    "merge_models",
    "merge_state_dicts",
    "unregister_merge_method",
]
